"""What the sandbox costs: `shell.run` of `true` confined and not, against bare processes; change capture.

    python -m bench.sandbox [N]

In one run, interleaved round by round so machine noise hits every row alike:
- anchors: bare `true` spawned with asyncio.create_subprocess_exec, and a bare
  `bwrap --ro-bind / / --proc /proc --dev /dev --unshare-pid true` spawned the same way;
- `shell.run true` through a device's dispatcher, unconfined (build_device(sandbox=False)) and
  sandboxed (the device's warm warden: a fork, namespaces and an overlay per command);
- change capture and apply: `cp` of 1 small file and `cp -r` of a directory of 1,000 small files
  into HOME (a fresh directory under /var/tmp, outside the temp dir), sandboxed (overlay, scan,
  journal, apply) against the same command unconfined. The copies are removed between rounds.

Goals (issue 9): the sandboxed call adds <= 1 ms over the bare bwrap it replaces; capture + apply of
1,000 small files <= 50 ms over the unconfined command; stretch: sandboxed `true` <= 2x unconfined.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench._stats import summary

ROUNDS_TRUE = 200
WARMUP = 5
BARE_BWRAP = ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--unshare-pid", "true"]
SESSION = "bench-sandbox"


async def _spawn(argv: list[str]) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    if await proc.wait() != 0:
        raise RuntimeError(f"{argv} exited with {proc.returncode}")


async def main(n: int) -> None:
    home = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-bench-home-")).resolve()
    os.environ["HOME"] = str(home)  # before any device is built: its write roots are this HOME and /tmp
    from tether.device.local import build_device
    from tether.protocol.models import Command
    from tether.tools.policy.model import policy_from_mapping

    bwrap = shutil.which("bwrap")
    true = shutil.which("true")
    if bwrap is None or true is None:
        sys.exit("bwrap is not installed: apt-get install -y bubblewrap")
    src = home / "src"
    (src / "many").mkdir(parents=True)
    (src / "one.txt").write_bytes(b"x" * 200)
    for i in range(1000):
        (src / "many" / f"f{i:04d}.txt").write_bytes(b"small file %d\n" % i)
    out = home / "out"
    out.mkdir()
    state = home / ".local" / "state" / "tether"
    policy = policy_from_mapping({"require_sandbox": False})
    boxed = build_device(policy=policy, state_dir=state, sandbox=True)
    if boxed.context.sandbox is None:
        sys.exit("no sandbox could be made here (see the warning above)")
    plain = build_device(policy=policy, state_dir=state, sandbox=False)
    for device in (boxed, plain):
        await device.computer_manager.get_or_create(None)
    counter = iter(range(10**9))

    def shell(device, cmd: str, argv: Callable[[], list[str]]) -> Callable[[], Awaitable[None]]:  # type: ignore[no-untyped-def]
        dispatcher = device.dispatcher(session_id=SESSION)

        async def call() -> None:
            params = {"cmd": cmd, "argv": argv(), "cwd": str(home)}
            [result] = await dispatcher.execute_commands([Command(tool_name="shell.run", parameters=params)])
            if not result.ok:
                raise RuntimeError(f"shell.run {cmd} failed: {result.error}")
        return call

    def fresh() -> str:
        return str(out / f"d{next(counter)}")

    fast: dict[str, Callable[[], Awaitable[None]]] = {
        "bare true (asyncio subprocess)": lambda: _spawn([true]),
        "bare bwrap --unshare-pid true": lambda: _spawn([bwrap, *BARE_BWRAP]),
        "shell.run true, unconfined": shell(plain, "true", list),
        "shell.run true, sandboxed": shell(boxed, "true", list),
    }
    files: dict[str, Callable[[], Awaitable[None]]] = {
        "cp 1 file, unconfined": shell(plain, "cp", lambda: [str(src / "one.txt"), fresh()]),
        "cp 1 file, sandboxed (capture + apply)": shell(boxed, "cp", lambda: [str(src / "one.txt"), fresh()]),
        "cp -r 1,000 files, unconfined": shell(plain, "cp", lambda: ["-r", str(src / "many"), fresh()]),
        "cp -r 1,000 files, sandboxed (capture + apply)": shell(boxed, "cp", lambda: ["-r", str(src / "many"),
                                                                                     fresh()]),
    }
    samples: dict[str, list[float]] = {name: [] for name in (*fast, *files)}

    async def rounds(rows: dict[str, Callable[[], Awaitable[None]]], count: int) -> None:
        for i in range(-WARMUP, count):
            for name, run in rows.items():
                started = time.perf_counter()
                await run()
                elapsed = time.perf_counter() - started
                if i >= 0:
                    samples[name].append(elapsed)
                if name in files:
                    shutil.rmtree(out)
                    out.mkdir()

    try:
        await rounds(fast, n)
        await rounds(files, max(3, n // 10))
    finally:
        for device in (boxed, plain):
            await device.aclose()
        shutil.rmtree(home, ignore_errors=True)

    print(f"sandbox cost, {n} interleaved rounds of `true` and {len(samples['cp 1 file, unconfined'])} of the copies "
          f"(+{WARMUP} warm-up), {os.cpu_count()} CPUs, {'root' if os.geteuid() == 0 else 'uid ' + str(os.getuid())}")
    rows = {name: summary(name, s) for name, s in samples.items()}
    ms = {name: row["p50_us"] / 1000 for name, row in rows.items()}

    def verdict(ok: bool) -> str:
        return "within" if ok else "OVER"

    print()
    bare, bwrap_ms = ms["bare true (asyncio subprocess)"], ms["bare bwrap --unshare-pid true"]
    unconfined, sandboxed = ms["shell.run true, unconfined"], ms["shell.run true, sandboxed"]
    print(f"ratio bare bwrap / bare true p50: {bwrap_ms / bare:.2f}x; shell.run unconfined / bare true: "
          f"{unconfined / bare:.2f}x")
    extra = sandboxed - bwrap_ms
    print(f"goal: sandboxed shell.run true <= bare bwrap + 1 ms: {sandboxed:.2f} ms vs {bwrap_ms:.2f} ms "
          f"({extra:+.2f} ms, {verdict(extra <= 1.0)})")
    ratio = sandboxed / unconfined
    print(f"stretch: sandboxed true <= 2x unconfined: {ratio:.2f}x ({sandboxed:.2f} vs {unconfined:.2f} ms, "
          f"{verdict(ratio <= 2.0)})")
    for label, a, b in (("1 file", "cp 1 file, unconfined", "cp 1 file, sandboxed (capture + apply)"),
                        ("1,000 files", "cp -r 1,000 files, unconfined",
                         "cp -r 1,000 files, sandboxed (capture + apply)")):
        over = ms[b] - ms[a]
        fixed = sandboxed - unconfined
        goal = f", goal <= 50 ms: {verdict(over <= 50.0)}" if label == "1,000 files" else ""
        print(f"capture + apply, {label}: {ms[b]:.2f} ms vs {ms[a]:.2f} ms unconfined ({over:+.2f} ms{goal}; "
              f"{over - fixed:+.2f} ms beyond the fixed cost of a sandboxed call); ratio {ms[b] / ms[a]:.2f}x")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS_TRUE))
