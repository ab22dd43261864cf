"""Multi-device tasks as graphs against the same tasks as sequential plans, on the agent server.

    python -m bench.graph_tasks [ROUNDS] [STEP_SECONDS]

One process, one event loop: the real agent app (`create_agent_app`: its `TaskService`, planner, executor and
SQLite store) under uvicorn on 127.0.0.1, four real devices (`build_device`, real sandboxed `shell.run`)
connected over AIP by `DeviceConnection`, and the scripted OpenAI-compatible server (`bench.kit.fake_llm`) as
the LLM. Each of the SUITE's tasks is asked in plain words; the scripted planner answers once with the
task's plan (and its final answer, so no answer call is needed): as a graph (ids and needs, the branches on
different devices) or as the equivalent sequential list (the same steps in an order that respects every
need). Each step is a `sleep STEP_SECONDS` in the device's sandbox, standing for the device's own work (the
four devices share this machine's CPUs, so CPU-bound work would measure the machine, not the plan). As root,
run it with TETHER_ALLOW_ROOT=1 TETHER_RUN_AS=root (docs/security/root.md), as the tests do.

Per round every task runs once each way, interleaved (which goes first alternates). Printed: per task the
median wall time of each and their ratio (goal: graph ≤ 0.7x sequential), the LLM calls of each (goal: the
graph's ≤ the sequential plan's), whether every run succeeded, and the average parallel width of the graph
runs (the steps' summed running time over the span from the first step's start to the last one's end).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._stats import spread
from bench.kit.fake_llm import FakeLLM
from bench.kit.served import serve
from tether.agent.server_app import create_agent_app
from tether.device.link.connection import DeviceConnection
from tether.device.local import build_device
from tether.device.probe import collect_profile
from tether.server.settings import ServerSettings
from tether.server.store import Store
from tether.tools.policy.model import default_policy

DEVICES = ("d1", "d2", "d3", "d4")


@dataclass(frozen=True)
class Job:
    """A task of the suite: its request and its steps as (id, device, needs)."""

    request: str
    steps: tuple[tuple[str, str, tuple[str, ...]], ...]


SUITE = (
    Job("gather the logs of three machines and summarise them on a fourth",
        (("g1", "d1", ()), ("g2", "d2", ()), ("g3", "d3", ()), ("sum", "d4", ("g1", "g2", "g3")))),
    Job("build on one machine, deploy to two",
        (("build", "d1", ()), ("dep2", "d2", ("build",)), ("dep3", "d3", ("build",)))),
    Job("check the health of every machine and report on the first",
        (("h1", "d1", ()), ("h2", "d2", ()), ("h3", "d3", ()), ("h4", "d4", ()),
         ("rep", "d1", ("h1", "h2", "h3", "h4")))),
    Job("back up two machines and verify the copies on a third",
        (("bk1", "d1", ()), ("bk2", "d2", ()), ("ver", "d3", ("bk1", "bk2")))),
    Job("check out on one machine, run the tests on three",
        (("co", "d1", ()), ("t2", "d2", ("co",)), ("t3", "d3", ("co",)), ("t4", "d4", ("co",)))),
    Job("rotate the logs on two machines, then clean up two others",
        (("rot1", "d1", ()), ("rot2", "d2", ()), ("cl3", "d3", ("rot1", "rot2")), ("cl4", "d4", ("rot1", "rot2")))),
    Job("two independent two-step chains joined on a third machine",
        (("a1", "d1", ()), ("a2", "d1", ("a1",)), ("b1", "d2", ()), ("b2", "d2", ("b1",)), ("j", "d3", ("a2", "b2")))),
    Job("build two services, test them together, deploy",
        (("s1", "d1", ()), ("s2", "d2", ()), ("it", "d3", ("s1", "s2")), ("dep", "d4", ("it",)))),
    Job("prepare, two checks in parallel, then publish",
        (("prep", "d1", ()), ("c2", "d2", ("prep",)), ("c3", "d3", ("prep",)), ("pub", "d4", ("c2", "c3")))),
    Job("collect metrics from four machines and chart them",
        (("m1", "d1", ()), ("m2", "d2", ()), ("m3", "d3", ()), ("m4", "d4", ()),
         ("chart", "d1", ("m1", "m2", "m3", "m4")))),
    Job("update three machines, then run a smoke test on each of two",
        (("u1", "d1", ()), ("u2", "d2", ()), ("u3", "d3", ()), ("sm1", "d4", ("u1", "u2", "u3")),
         ("sm2", "d1", ("u1", "u2", "u3")))),
)


def plan_reply(job: Job, graph: bool, cwd: str, seconds: float) -> str:
    """The scripted planner's answer: the job as a graph, or as the sequential list of the same steps."""
    steps: list[dict[str, Any]] = []
    for ident, device, needs in job.steps:
        step: dict[str, Any] = {"skill": "shell.run", "device": device, "description": ident,
                                "args": {"cmd": "sleep", "argv": [f"{seconds:g}"], "cwd": cwd}}
        if graph:
            step.update(id=ident, needs=list(needs))
        steps.append(step)
    return json.dumps({"steps": steps, "answer": f"{job.request}: done"})


def parallel_width(events: list[Any]) -> float:
    """The steps' summed running time over the span from the first start to the last end."""
    starts: dict[tuple[int, int], float] = {}
    busy = 0.0
    first, last = float("inf"), 0.0
    for event in events:
        key = (event.data.get("step"), event.data.get("attempt"))
        at = event.at.timestamp()
        if event.kind == "step_started":
            starts[key] = at
            first = min(first, at)
        elif event.kind == "step_finished" and key in starts:
            busy += at - starts.pop(key)
            last = max(last, at)
    return busy / (last - first) if last > first else 1.0


async def main(rounds: int, seconds: float) -> None:
    with tempfile.TemporaryDirectory(prefix="tether-bench-graph-") as tmp:
        root = Path(tmp)
        async with FakeLLM([]) as fake:
            settings = ServerSettings(db_path=root / "server.db")
            store = Store(settings.db_path)
            app = create_agent_app(settings, store, llm_settings=fake.settings())
            port, stop_server = await serve(app)
            policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
            links = []
            for name in DEVICES:
                device = build_device(policy=policy, state_dir=root / f"state-{name}", client_id=name, sandbox=True)
                if device.context.sandbox is None:
                    sys.exit("no sandbox could be made here (the log says why; as root, run with TETHER_ALLOW_ROOT=1 "
                             "TETHER_RUN_AS=root, see docs/security/root.md)")
                link = DeviceConnection(device.client, f"ws://127.0.0.1:{port}/aip",
                                        store.tokens.create("device", name)[1], name=name,
                                        profile=lambda device=device: collect_profile(device))  # type: ignore[misc]
                links.append((device, link, asyncio.create_task(link.run())))
                await asyncio.wait_for(link.connected.wait(), 30)
            service = app.state.tasks

            async def once(job: Job, graph: bool) -> tuple[float, int, bool, float]:
                fake.add(plan_reply(job, graph, str(root), seconds))
                started = time.perf_counter()
                task = await service.create(job.request, device="d1", devices=list(DEVICES[1:]))
                await asyncio.wait_for(service.wait(task.id), 300)
                wall = time.perf_counter() - started
                return wall, task.counters.llm_calls, task.state.value == "done", parallel_width(task.events)

            rows: dict[str, dict[str, list[Any]]] = {}
            try:
                await once(SUITE[0], True)
                await once(SUITE[0], False)  # warm both paths
                for r in range(rounds):
                    for i, job in enumerate(SUITE):
                        order = (True, False) if (r + i) % 2 == 0 else (False, True)
                        for graph in order:
                            wall, calls, ok, width = await once(job, graph)
                            row = rows.setdefault(job.request, {"graph": [], "seq": []})
                            row["graph" if graph else "seq"].append((wall, calls, ok, width))
            finally:
                for _, link, _ in links:
                    link.stop()
                await asyncio.gather(*(job for _, _, job in links), return_exceptions=True)
                for device, _, _ in links:
                    await device.aclose()
                await stop_server()
    report(rows, rounds, seconds)


def report(rows: dict[str, dict[str, list[Any]]], rounds: int, seconds: float) -> None:
    print(f"{len(rows)} multi-device tasks on 4 devices, each as a graph and as the equivalent sequential plan; "
          f"{rounds} rounds, interleaved; each step a {seconds:g} s wait in the device's sandbox")
    print(f"{'task':<58} {'graph s':>8} {'seq s':>7} {'ratio':>6} {'llm g/s':>8} {'ok':>4} {'width':>6}")
    ratios, widths, all_ok, fewer_calls = [], [], True, True
    for request, row in rows.items():
        g = statistics.median(w for w, *_ in row["graph"])
        s = statistics.median(w for w, *_ in row["seq"])
        g_calls = max(c for _, c, _, _ in row["graph"])
        s_calls = min(c for _, c, _, _ in row["seq"])
        ok = all(o for _, _, o, _ in row["graph"] + row["seq"])
        width = statistics.fmean(w for *_, w in row["graph"])
        ratios.append(g / s)
        widths.append(width)
        all_ok &= ok
        fewer_calls &= g_calls <= s_calls
        print(f"{request[:58]:<58} {g:8.2f} {s:7.2f} {g / s:6.2f} {g_calls:>4}/{s_calls:<3} {'yes' if ok else 'NO':>4} "
              f"{width:6.2f}")
    total_g = sum(statistics.median(w for w, *_ in row["graph"]) for row in rows.values())
    total_s = sum(statistics.median(w for w, *_ in row["seq"]) for row in rows.values())
    print(f"wall time, graph / sequential: {total_g / total_s:.2f}x over the suite (goal <= 0.7x); per task median "
          f"{statistics.median(ratios):.2f}x, spread {spread(ratios)}")
    print(f"LLM calls: graph <= sequential for every task: {'yes' if fewer_calls else 'NO'}; every run succeeded: "
          f"{'yes' if all_ok else 'NO'}; average parallel width of the graph runs: {statistics.fmean(widths):.2f}")


if __name__ == "__main__":
    args = sys.argv[1:3]
    asyncio.run(main(int(args[0]) if args else 3, float(args[1]) if len(args) > 1 else 0.3))
