"""A graph task as data and as text: what the task API returns (`graph_of`) and `tether log` draws
(`draw`, plain text within 80 columns, one line per step, grouped by stage: a step's stage is one more
than the deepest stage of the steps it needs, so the steps of one stage may run at the same time)."""

from __future__ import annotations

from typing import Any

from tether.agent.planning.graph import dependencies, is_graph
from tether.agent.run.task import Task

MARKS = {"pending": " ", "running": ">", "done": "+", "failed": "x", "skipped": "-", "replaced": "~", "removed": "/"}
WIDTH = 80


def graph_of(task: Task) -> dict[str, Any] | None:
    """The task's plan as a graph: `nodes` (step from 0, id, skill, device, state, needs as steps from 0,
    when, stage) and `width` (the most steps in one stage); None when the plan is a plain list."""
    if task.plan is None or not is_graph(task.plan.steps):
        return None
    states = task.step_states + ["pending"] * (len(task.plan.steps) - len(task.step_states))
    dropped = {i for i, s in enumerate(states) if s in ("removed", "replaced")}
    deps = dependencies(task.plan.steps, dropped)
    stage: dict[int, int] = {}

    def depth(index: int, seen: frozenset[int] = frozenset()) -> int:
        if index not in stage:
            stage[index] = 1 + max((depth(d, seen | {index}) for d in deps[index] if d not in seen), default=-1)
        return stage[index]

    nodes: list[dict[str, Any]] = []
    for index, step in enumerate(task.plan.steps):
        when = step.when if isinstance(step.when, str) else step.when.model_dump(exclude_defaults=True)
        nodes.append({"step": index, "id": step.id, "skill": step.skill, "state": states[index],
                      "device": step.device or task.step_devices.get(str(index)) or task.device, "needs": deps[index],
                      "when": when, "stage": depth(index)})
    counts: dict[int, int] = {}
    for node in nodes:
        if node["state"] not in ("removed", "replaced"):
            counts[node["stage"]] = counts.get(node["stage"], 0) + 1
    return {"nodes": nodes, "width": max(counts.values(), default=0)}


def draw(task: Task) -> list[str]:
    """The graph in plain text lines of at most 80 columns (empty for a list plan)."""
    graph = graph_of(task)
    if graph is None:
        return []
    nodes = graph["nodes"]
    name = {n["step"]: n["id"] or str(n["step"] + 1) for n in nodes}
    lines = [f"graph: {len(nodes)} steps, up to {graph['width']} at once",
             "  (+ done, > running, x failed, - skipped, ~ replaced, / removed; <- needs)"]
    for stage in sorted({n["stage"] for n in nodes}):
        members = [n for n in nodes if n["stage"] == stage]
        for k, node in enumerate(members):
            branch = "└─" if k == len(members) - 1 else "├─"
            head = f"{stage:>2} " if k == 0 else "   "
            when = node["when"] if isinstance(node["when"], str) else "if " + str(node["when"].get("ref", ""))
            needs = ", ".join(name[d] for d in node["needs"])
            text = (f"{head}{branch}[{MARKS.get(node['state'], '?')}] {node['step'] + 1:>2} {name[node['step']]:<10} "
                    f"{node['skill']}" + (f" @{node['device']}" if node["device"] else "")
                    + (f" <- {needs}" if needs else "") + ("" if when == "success" else f" ({when})"))
            lines.append(text if len(text) <= WIDTH else text[:WIDTH - 1] + "…")
    return lines
