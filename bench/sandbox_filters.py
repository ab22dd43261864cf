"""What the IPC filters and resource limits cost a sandboxed command (issue 26, items 3 and 5).

    python -m bench.sandbox_filters [N] [REPEATS]

In one run, interleaved round by round so machine noise hits every row alike, REPEATS times over:
- anchor: a bare `bwrap --ro-bind / / --proc /proc --dev /dev --unshare-pid true`, spawned with asyncio;
- `true` through the device's warm warden (`Sandbox.spawn`, with a capture layer as shell.run uses)
  without the filters (`Sandbox.filters = False`: no seccomp, no Landlock scopes, no limits, no private
  /dev/shm), with them (the default policy: no unix socket, the default limits), and with them plus one
  named socket (`allow_sockets`: the machine's other unix sockets are listed and masked per command),
  and with them but without the next command's namespace made between commands (`Sandbox.prime = False`:
  the clone and mounts then happen on the command's clock);
- `shell.run true` through a device's dispatcher, sandboxed with the filters, sandboxed without them, and
  unconfined.

Each row prints its median over the repeats and their spread (min..max of the per-repeat medians), its
ratio to the bare bwrap anchor of the same run, and the CPU time one call costs (the device process, plus
the warden and the command processes it reaped, or the processes the device reaped itself): CPU time is
far less noisy than wall time on a busy machine. The filters' cost is the median of the per-round
differences (on - off, measured back to back), which cancels the drift of a busy machine.
Goals: the filters add <= 0.3 ms (with - without); sandboxed `shell.run true` <= bare bwrap + 1 ms.
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench._stats import spread

ROUNDS = 200
REPEATS = 3
WARMUP = 5
BARE_BWRAP = ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--unshare-pid", "true"]
SESSION = "bench-filters"
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _cpu_s(warden: int | None) -> float:
    """CPU seconds so far of this process, the processes it reaped, and `warden` with the ones it reaped."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = time.process_time() + children.ru_utime + children.ru_stime
    if warden:
        try:
            with open(f"/proc/{warden}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
            with open(f"/proc/{warden}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[13]) + int(fields[14])) * TICK_S  # cutime + cstime: its commands
        except (OSError, ValueError, IndexError):
            pass
    return total


async def _spawn(argv: list[str]) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    if await proc.wait() != 0:
        raise RuntimeError(f"{argv} exited with {proc.returncode}")


async def main(n: int, repeats: int) -> None:
    home = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-bench-home-")).resolve()
    os.environ["HOME"] = str(home)  # before any device is built: its write roots are this HOME and /tmp
    from tether.device.local import build_device
    from tether.protocol.models import Command
    from tether.sandbox.runner import Sandbox
    from tether.tools.policy.model import policy_from_mapping
    from tether.tools.running.sandboxing import make_sandbox

    bwrap, true = shutil.which("bwrap"), shutil.which("true")
    if bwrap is None or true is None:
        sys.exit("bwrap is not installed: apt-get install -y bubblewrap")
    named = home / "named.sock"
    listener = await asyncio.start_unix_server(lambda r, w: w.close(), path=str(named))
    state = home / ".local" / "state" / "tether"
    policy = policy_from_mapping({"require_sandbox": False})
    boxes: dict[str, Sandbox] = {}
    for name, pol in (("off", policy), ("on", policy), ("unprimed", policy),
                      ("named", policy.model_copy(update={"allow_sockets": [str(named)]}))):
        box = make_sandbox(pol, hidden=[str(state)])
        if box is None:
            sys.exit("no sandbox could be made here (see the warning above)")
        box.filters = name != "off"
        box.prime = name != "unprimed"
        boxes[name] = box
    boxed = build_device(policy=policy, state_dir=state, sandbox=True)
    boxed_off = build_device(policy=policy, state_dir=state, sandbox=True)
    plain = build_device(policy=policy, state_dir=state, sandbox=False)
    if boxed.context.sandbox is None or boxed_off.context.sandbox is None:
        sys.exit("no sandbox could be made here (see the warning above)")
    boxed_off.context.sandbox.filters = False
    devices = (boxed, boxed_off, plain)
    for device in devices:
        await device.computer_manager.get_or_create(None)

    def spawn_true(box: Sandbox) -> Callable[[], Awaitable[None]]:
        async def call() -> None:
            layer = box.new_layer()
            proc = await box.spawn(["true"], executable=true, cwd=str(home), env={"PATH": "/usr/bin:/bin"},
                                   stdin=False, layer=layer)
            assert proc.stdout is not None and proc.stderr is not None
            await asyncio.gather(proc.stdout.read(), proc.stderr.read())
            code = await proc.wait()
            box.release(layer)
            if code != 0:
                raise RuntimeError(f"sandboxed true exited with {code}")
        return call

    def shell(device, cmd: str) -> Callable[[], Awaitable[None]]:  # type: ignore[no-untyped-def]
        dispatcher = device.dispatcher(session_id=SESSION)

        async def call() -> None:
            params = {"cmd": cmd, "argv": [], "cwd": str(home)}
            [result] = await dispatcher.execute_commands([Command(tool_name="shell.run", parameters=params)])
            if not result.ok:
                raise RuntimeError(f"shell.run {cmd} failed: {result.error}")
        return call

    anchor = "bare bwrap --unshare-pid true (anchor)"
    sandboxed, sandboxed_off = "shell.run true, sandboxed (filters on)", "shell.run true, sandboxed (filters off)"
    rows: dict[str, Callable[[], Awaitable[None]]] = {
        anchor: lambda: _spawn([bwrap, *BARE_BWRAP]),
        "warden true, filters off": spawn_true(boxes["off"]),
        "warden true, filters on": spawn_true(boxes["on"]),
        "warden true, filters on, not primed": spawn_true(boxes["unprimed"]),
        "warden true, filters on + 1 allowed socket": spawn_true(boxes["named"]),
        sandboxed: shell(boxed, "true"),
        sandboxed_off: shell(boxed_off, "true"),
        "shell.run true, unconfined": shell(plain, "true"),
    }
    for run in rows.values():  # every warden started before its row is timed
        await run()
    wardens: dict[str, Sandbox | None] = {
        anchor: None, "warden true, filters off": boxes["off"], "warden true, filters on": boxes["on"],
        "warden true, filters on + 1 allowed socket": boxes["named"],
        "warden true, filters on, not primed": boxes["unprimed"], sandboxed: boxed.context.sandbox,
        sandboxed_off: boxed_off.context.sandbox, "shell.run true, unconfined": None}
    cpu: dict[str, float] = dict.fromkeys(rows, 0.0)  # CPU seconds of the timed calls, per row
    medians: dict[str, list[float]] = {name: [] for name in rows}
    paired: list[float] = []  # per repeat: the median of (filters on - filters off) within each round
    paired_named: list[float] = []  # the same for filters on with a named socket
    paired_primed: list[float] = []  # per repeat: the median of (primed - not primed), filters on
    try:
        for _ in range(repeats):
            samples: dict[str, list[float]] = {name: [] for name in rows}
            for i in range(-WARMUP, n):
                for name, run in rows.items():
                    box = wardens[name]
                    warden = box._warden_host_pid if box is not None else None
                    cpu_before = _cpu_s(warden)
                    started = time.perf_counter()
                    await run()
                    if i >= 0:
                        samples[name].append(time.perf_counter() - started)
                        cpu[name] += _cpu_s(warden) - cpu_before
            for name, s in samples.items():
                medians[name].append(statistics.median(s) * 1000)
            off_samples = samples["warden true, filters off"]
            for into, row in ((paired, "warden true, filters on"),
                              (paired_named, "warden true, filters on + 1 allowed socket")):
                diffs = [on - off for on, off in zip(samples[row], off_samples, strict=True)]
                into.append(statistics.median(diffs) * 1000)
            paired_primed.append(statistics.median(
                [a - b for a, b in zip(samples["warden true, filters on"],
                                       samples["warden true, filters on, not primed"], strict=True)]) * 1000)
    finally:
        for device in devices:
            await device.aclose()
        for box in boxes.values():
            await box.aclose()
        listener.close()
        shutil.rmtree(home, ignore_errors=True)

    print(f"IPC filters and limits, {repeats} repeats of {n} interleaved rounds (+{WARMUP} warm-up each), "
          f"{os.cpu_count()} CPUs, {'root' if os.geteuid() == 0 else 'uid ' + str(os.getuid())}")
    ms = {name: statistics.median(m) for name, m in medians.items()}
    cpu_ms = {name: total / (n * repeats) * 1000 for name, total in cpu.items()}
    for name, m in medians.items():
        print(f"{name:<46} p50 {ms[name]:7.3f} ms   spread {spread(m):<16} "
              f"ratio to anchor {ms[name] / ms[anchor]:5.2f}x   CPU {cpu_ms[name]:6.3f} ms/call")
    print()
    cost = statistics.median(paired)
    of_medians = ms["warden true, filters on"] - ms["warden true, filters off"]
    print(f"goal: the filters add <= 0.3 ms: {cost:+.3f} ms (median of the per-round differences; per repeat "
          f"{spread(paired)} ms; difference of the medians {of_medians:+.3f} ms), "
          f"{'within' if cost <= 0.3 else 'OVER'}")
    primed = statistics.median(paired_primed)
    print(f"the next command's namespace made between commands (primed) saves {-primed:.3f} ms per call (median "
          f"of the per-round differences primed - not primed; per repeat {spread(paired_primed)} ms)")
    print(f"with a named socket (the machine's unix sockets listed and masked per command): "
          f"{statistics.median(paired_named):+.3f} ms (per repeat {spread(paired_named)} ms)")
    print(f"shell.run true, sandboxed, filters on - off: {ms[sandboxed] - ms[sandboxed_off]:+.3f} ms "
          f"(CPU {cpu_ms[sandboxed] - cpu_ms[sandboxed_off]:+.3f} ms)")
    extra = ms[sandboxed] - ms[anchor]
    print(f"goal: sandboxed shell.run true <= bare bwrap + 1 ms: {extra:+.3f} ms "
          f"(CPU {cpu_ms[sandboxed] - cpu_ms[anchor]:+.3f} ms; unconfined {ms['shell.run true, unconfined']:.3f} ms), "
          f"{'within' if extra <= 1 else 'OVER'}")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS,
                     int(sys.argv[2]) if len(sys.argv) > 2 else REPEATS))
