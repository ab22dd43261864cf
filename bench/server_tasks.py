"""Per-step cost of a task on the agent server, against the same commands sent straight to the device.

    python -m bench.server_tasks [TASKS] [STEPS]

One process, one event loop: the real agent app (`create_agent_app`, its `TaskService` and SQLite
store) served by uvicorn on 127.0.0.1, and a real device (`build_device`) connected over AIP by a
`DeviceConnection`. Each round runs a given plan of STEPS `read_file` steps as a server task
(`service.create` and waiting for it to end: no LLM, so this is the executor, the store and the
hub) and, as the anchor, the same STEPS commands one at a time through `hub.dispatcher(...)`, the
path a REST caller's batch takes. Rounds alternate which goes first. Reported: per-step p50 of
both (task time / steps), the difference (what a server task adds per step: planning checks,
events, the saves that make the task survive a restart) and the ratio.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from bench._stats import pct
from bench.kit.served import serve
from tether.agent.planning.plan import Plan, PlanStep
from tether.agent.server_app import create_agent_app
from tether.device.link.connection import DeviceConnection
from tether.device.local import build_device
from tether.device.probe import collect_profile
from tether.protocol.models import Command
from tether.server.settings import ServerSettings
from tether.server.store import Store
from tether.tools.policy.model import default_policy


async def main(tasks: int, steps: int) -> None:
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        root = Path(tmp)
        target = root / "data.txt"
        target.write_text("x" * 100)
        settings = ServerSettings(db_path=root / "server.db")
        store = Store(settings.db_path)
        app = create_agent_app(settings, store)
        port, stop_server = await serve(app)
        policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
        device = build_device(policy=policy, state_dir=root / "state", client_id="bench")
        link = DeviceConnection(device.client, f"ws://127.0.0.1:{port}/aip", store.tokens.create("device", "bench")[1],
                                name="bench", profile=lambda: collect_profile(device))
        linking = asyncio.create_task(link.run())
        await asyncio.wait_for(link.connected.wait(), 30)
        service, hub = app.state.tasks, app.state.hub
        args = {"file_path": str(target)}
        plan = Plan(steps=[PlanStep(skill="read_file", args=args)] * steps)

        async def as_task() -> float:
            started = time.perf_counter()
            task = await service.create("read it", plan=plan.model_copy(deep=True), device="bench")
            await asyncio.wait_for(service.wait(task.id), 120)
            if task.state.value != "done":
                raise RuntimeError(f"the task ended {task.state.value}: {task.error}")
            return (time.perf_counter() - started) / steps

        async def direct() -> float:
            dispatcher = hub.dispatcher("bench", requested_by="bench")
            started = time.perf_counter()
            for _ in range(steps):
                [result] = await dispatcher.execute_commands([Command(tool_name="read_file", parameters=args)])
                if not result.ok:
                    raise RuntimeError(result.error)
            return (time.perf_counter() - started) / steps

        try:
            await as_task()
            await direct()  # warm both paths
            task_samples: list[float] = []
            direct_samples: list[float] = []
            for i in range(tasks):
                if i % 2:
                    task_samples.append(await as_task())
                    direct_samples.append(await direct())
                else:
                    direct_samples.append(await direct())
                    task_samples.append(await as_task())
        finally:
            link.stop()
            await asyncio.gather(linking, return_exceptions=True)
            await device.aclose()
            await stop_server()
    d50, t50 = pct(direct_samples, 50) * 1e6, pct(task_samples, 50) * 1e6
    d99, t99 = pct(direct_samples, 99) * 1e6, pct(task_samples, 99) * 1e6
    print(f"server task of {steps} read_file steps vs the same commands through hub.dispatcher; "
          f"{tasks} rounds, interleaved")
    print(f"{'anchor: hub.dispatcher per step':<44} p50 {d50:8.1f} us   p99 {d99:8.1f} us")
    print(f"{'server task: task time / steps':<44} p50 {t50:8.1f} us   p99 {t99:8.1f} us")
    print(f"a server task adds p50 {t50 - d50:.0f} us per step (ratio to anchor p50 {t50 / d50:.2f}x)")


if __name__ == "__main__":
    argv = [int(a) for a in sys.argv[1:3]]
    asyncio.run(main(*(argv + [40, 20][len(argv):])))
