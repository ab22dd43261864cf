"""Does one command that makes 100,000 files stall the other sessions? (issue 26, item 4)

    python -m bench.capture_stall [N_FILES] [ROUNDS]

A real device with its sandbox, served as a server serves it (its `BatchRunner`: sessions side by
side, results encoded into frames). Each round, interleaved so machine noise hits both rows alike:
- anchor: session `other` runs `shell.run true` back to back, with nothing else going on;
- load: session `big` runs a Python script that creates N_FILES empty files in a fresh directory in
  the temp dir (captured in its overlay layer, scanned, journaled and applied), and session `other`
  runs `shell.run true` back to back for as long as `big` is in flight.
The files are removed between rounds, outside the measured time.

Printed: each round's p50/p99 of `other`'s `true`, then the median of the rounds' p99 with its spread
(min..max). Goal: `true` p99 during the load <= 100 ms. Before capture and apply ran off the event
loop, the same load stalled other sessions for 8.4 s.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._stats import pct, spread

N_FILES = 100_000
ROUNDS = 3
ANCHOR_CALLS = 60
GOAL_MS = 100.0
PY = "/usr/bin/python3"
MAKE_FILES = """
import os, sys
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
for i in range(int(sys.argv[2])):
    open(os.path.join(d, "f%06d" % i), "w").close()
"""


class Served:
    """A device driven through its BatchRunner; each result is the decoded frame a server would read."""

    def __init__(self, device: Any) -> None:
        from tether.device.link.batch_runner import BatchRunner
        from tether.device.link.finished import FinishedRecord
        from tether.device.link.outbox import Outbox

        self.device = device
        self.outbox = Outbox()
        self.outbox.open(8 << 20)
        self.runner = BatchRunner(device.client, self.outbox, FinishedRecord(), client_id="bench",
                                  max_concurrent_sessions=4)
        self.waiting: dict[str, asyncio.Future[Any]] = {}
        self.pump = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        from tether.protocol.codec import decode_client_message
        from tether.protocol.messages import ClientMessageType

        while True:
            while (frame := self.outbox.pop()) is not None:
                msg = decode_client_message(frame[1], 1 << 30)
                if msg.type is ClientMessageType.COMMAND_RESULTS and msg.prev_response_id in self.waiting:
                    self.waiting.pop(msg.prev_response_id).set_result(msg.action_results[0])
            self.outbox.ready.clear()
            await self.outbox.ready.wait()

    async def run(self, session: str, cmd: str, argv: list[str], cwd: str) -> Any:
        from tether.protocol.messages import ServerMessage, ServerMessageType
        from tether.protocol.models import Command

        msg = ServerMessage(type=ServerMessageType.COMMAND, session_id=session, timeout=600,
                            actions=[Command(tool_name="shell.run", parameters={"cmd": cmd, "argv": argv, "cwd": cwd})])
        self.waiting[msg.response_id] = asyncio.get_running_loop().create_future()
        self.runner.submit(msg)
        result = await asyncio.wait_for(self.waiting[msg.response_id], 900)
        if not result.ok:
            raise RuntimeError(f"{cmd} failed: {result.error}")
        return result

    async def aclose(self) -> None:
        await self.runner.abort_all(timeout=10)
        self.pump.cancel()
        await asyncio.gather(self.pump, return_exceptions=True)


async def _trues(served: Served, cwd: str, *, count: int | None = None, until: asyncio.Future[Any] | None = None
                 ) -> list[float]:
    samples: list[float] = []
    while (count is not None and len(samples) < count) or (until is not None and not until.done()):
        start = time.perf_counter()
        await served.run("other", "true", [], cwd)
        samples.append(time.perf_counter() - start)
    return samples


def _row(name: str, samples: list[float]) -> tuple[float, float]:
    ms = [s * 1000 for s in samples]
    p50, p99 = pct(ms, 50), pct(ms, 99)
    print(f"  {name:<34} p50 {p50:8.1f} ms   p99 {p99:8.1f} ms   max {max(ms):8.1f} ms   n={len(ms)}")
    return p50, p99


async def main(n_files: int = N_FILES, rounds: int = ROUNDS) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-bench-home-")).resolve()
    os.environ["HOME"] = str(home)  # before the device is built: its write roots are this HOME and the temp dir
    from tether.device.local import build_device
    from tether.tools.policy.model import policy_from_mapping

    if shutil.which("bwrap") is None:
        sys.exit("bwrap is not installed: apt-get install -y bubblewrap")
    script = home / "make_files.py"
    script.write_text(MAKE_FILES)
    state = home / ".local/state/tether"
    state.mkdir(parents=True)
    # the files go to a directory in the temp dir named as a write root: the machine's, captured (the rest of
    # /tmp is each session's private /tmp, which is not captured)
    scratch = Path(tempfile.mkdtemp(prefix="tether-bench-capture-")).resolve()
    roots = {"write_roots": [str(home), tempfile.gettempdir(), str(scratch)]}
    device = build_device(policy=policy_from_mapping(roots), state_dir=state, sandbox=True)
    if device.context.sandbox is None:
        sys.exit("no sandbox could be made here (see the log for why)")
    served = Served(device)
    anchor_p99: list[float] = []
    load_p99: list[float] = []
    try:
        await _trues(served, str(home), count=5)  # warm the warden
        print(f"capture stall: `shell.run true` of another session while one command makes {n_files:,} files")
        for r in range(rounds):
            print(f"round {r + 1}/{rounds}")
            anchor_p99.append(_row("true, no load (anchor)", await _trues(served, str(home), count=ANCHOR_CALLS))[1])
            target = scratch / f"round{r}"
            started = time.perf_counter()
            big = asyncio.ensure_future(served.run("big", PY, [str(script), str(target), str(n_files)], str(home)))
            samples = await _trues(served, str(home), until=big)
            result = await big
            took = time.perf_counter() - started
            load_p99.append(_row(f"true, during {n_files:,} files", samples)[1])
            listed = result.result["changes"]
            total = listed[-1].get("total", len(listed)) if listed else 0
            print(f"  the big command took {took:.1f} s (ran, captured, journaled and applied: {total:,} changes)")
            if len(os.listdir(target)) != n_files:
                raise RuntimeError(f"{target} holds {len(os.listdir(target))} files, not {n_files}")
            await asyncio.to_thread(shutil.rmtree, target)
        med_anchor, med_load = statistics.median(anchor_p99), statistics.median(load_p99)
        print(f"true p99, no load (anchor): median {med_anchor:.1f} ms (spread {spread(anchor_p99)} ms)")
        print(f"true p99, during {n_files:,} files: median {med_load:.1f} ms (spread {spread(load_p99)} ms)   "
              f"goal <= {GOAL_MS:g} ms: {'met' if med_load <= GOAL_MS else 'NOT met'}")
        return {"anchor_p99_ms": med_anchor, "load_p99_ms": med_load}
    finally:
        await served.aclose()
        await device.aclose()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    asyncio.run(main(*args))
