"""What a task's follower waits for each event, and what a task costs per step, against the tree before.

    python -m bench.task_follow --base SRC [--rounds 6] [--tasks 8] [--steps 20]

Each round runs two child processes one after the other (the order alternates): this tree and `--base` (another
checkout's `src`, e.g. `git archive main src | tar -x -C /tmp/b`). A child serves the real agent app (its
`TaskService` and SQLite store) with uvicorn on 127.0.0.1 and connects a real device (`build_device`) over AIP;
it runs TASKS given plans of STEPS `read_file` steps, each followed as `tether log --follow` does: the task's
server-sent event stream over HTTP. Per event, the follower's wait is the time it reads the event less the event's
own time (`at`, stamped when the runner recorded it; one process, one clock); the same is measured in the process,
on a queue of the task service's followers (`subscribe`: what it tells, without HTTP), from the task's creation
on. A child reports the median of both waits over its events (plan, steps, states: told once saved), the time
per step (task created to its end, over STEPS) and the CPU per step (user + system of the process, which holds
the server, the device and the follower). Printed: each side's medians over the rounds with their spread, the
ratio this tree / base per round, and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench._stats import spread
from bench.kit.served import serve

FIGURES = ("sse_wait_us", "service_wait_us", "step_us", "cpu_us_per_step")


async def child(tasks: int, steps: int) -> dict[str, float]:
    """One side's run: its medians (see the module's docstring)."""
    import httpx

    from tether.agent.server_app import create_agent_app
    from tether.device.link.connection import DeviceConnection
    from tether.device.local import build_device
    from tether.device.probe import collect_profile
    from tether.server.settings import ServerSettings
    from tether.server.store import Store
    from tether.tools.policy.model import default_policy

    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        root = Path(tmp)
        target = root / "data.txt"
        target.write_text("x" * 100)
        settings = ServerSettings(db_path=root / "server.db")
        store = Store(settings.db_path)
        token = store.tokens.create("api", "bench", ["read", "execute"])[1]
        app = create_agent_app(settings, store)
        port, stop_server = await serve(app)
        policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
        device = build_device(policy=policy, state_dir=root / "state", client_id="bench")
        link = DeviceConnection(device.client, f"ws://127.0.0.1:{port}/aip", store.tokens.create("device", "bench")[1],
                                name="bench", profile=lambda: collect_profile(device))
        linking = asyncio.create_task(link.run())
        await asyncio.wait_for(link.connected.wait(), 30)
        api = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/api/v1",
                                headers={"Authorization": f"Bearer {token}"}, timeout=60)
        plan = [{"skill": "read_file", "args": {"file_path": str(target)}}] * steps
        sse: list[float] = []
        inside: list[float] = []
        per_step: list[float] = []
        service = app.state.tasks

        async def drain(queue: asyncio.Queue[Any]) -> None:
            while (event := await queue.get()) is not None:
                inside.append(time.time() - event.at.timestamp())

        async def one(record: bool) -> None:
            started = time.perf_counter()
            created = await api.post("/tasks", json={"request": "read it", "device": "bench", "plan": plan})
            if created.status_code != 201:
                raise RuntimeError(created.text)
            _, _, queue = service.subscribe(created.json()["id"])  # what comes next, as told in the process
            draining = asyncio.create_task(drain(queue)) if record and queue is not None else None
            kind = None
            state = None
            async with api.stream("GET", f"/tasks/{created.json()['id']}/events") as response:
                async for line in response.aiter_lines():
                    if line.startswith("event:"):
                        kind = line[6:].strip()
                    elif line.startswith("data:") and kind == "end":
                        state = json.loads(line[5:])["state"]
                        break
                    elif line.startswith("data:"):
                        now = time.time()
                        event = json.loads(line[5:])
                        wait = now - datetime.fromisoformat(event["at"]).timestamp()
                        if record:
                            sse.append(wait)
            if draining is not None:
                await asyncio.wait_for(draining, 30)
            if state != "done":
                raise RuntimeError(f"the task ended {state}")
            if record:
                per_step.append((time.perf_counter() - started) / steps)

        try:
            await one(False)  # warm the paths
            cpu = time.process_time()
            for _ in range(tasks):
                await one(True)
            cpu = time.process_time() - cpu
        finally:
            await api.aclose()
            link.stop()
            await asyncio.gather(linking, return_exceptions=True)
            await device.aclose()
            await stop_server()
    return {"sse_wait_us": statistics.median(sse) * 1e6, "service_wait_us": statistics.median(inside) * 1e6,
            "step_us": statistics.median(per_step) * 1e6, "cpu_us_per_step": cpu / (tasks * steps) * 1e6}


def run_side(src: Path | None, tasks: int, steps: int) -> dict[str, float]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", "bench.task_follow", "--child", "--tasks", str(tasks),
                           "--steps", str(steps)], env=env, capture_output=True, text=True, check=False,
                          cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0:
        raise SystemExit(f"a child failed ({'base' if src else 'this tree'}):\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.task_follow", description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, metavar="SRC", help="the other checkout's src")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1 or args.tasks < 1 or args.steps < 1:
        sys.exit("--rounds, --tasks and --steps must be at least 1")
    if args.child:
        print(json.dumps(asyncio.run(child(args.tasks, args.steps))))
        return
    if args.base is None or not (args.base / "tether").is_dir():
        sys.exit("--base must be a src holding tether/")
    sides: dict[str, list[dict[str, float]]] = {"this tree": [], "base": []}
    for i in range(args.rounds):
        order = [("this tree", None), ("base", args.base.resolve())]
        for name, src in order if i % 2 == 0 else reversed(order):
            sides[name].append(run_side(src, args.tasks, args.steps))
    print(f"{args.rounds} rounds (order alternating) of {args.tasks} tasks x {args.steps} read_file steps each, "
          f"followed over SSE; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for figure in FIGURES:
        mine = [r[figure] for r in sides["this tree"]]
        base = [r[figure] for r in sides["base"]]
        ratios = [m / b for m, b in zip(mine, base, strict=True) if b]
        print(f"{figure:<18} this tree {statistics.median(mine):9.1f} ({spread(mine)})   base "
              f"{statistics.median(base):9.1f} ({spread(base)})   ratio per round "
              f"{statistics.median(ratios) if ratios else float('nan'):.3f}x ({spread(ratios) if ratios else '-'})")


if __name__ == "__main__":
    main()
