"""The shape of a graph plan: which step needs which, and what is wrong with it.

A step may carry an `id` and `needs: [ids]`. A need is a step's id, or its number counted from 1 as a
string ("2"). A step whose `needs` is absent (None) needs the step listed before it, so a plain list of
steps is a chain, run one after another as always; `needs: []` makes a step a root that starts at once.
A plan is a graph when any step has `needs` or a `when` other than `success` (`is_graph`).

`structure_problems` refuses duplicate or malformed ids, unknown needs, a step needing itself, and
cycles (naming the steps around it). `dependencies` and `ancestors` give the executor and the plan
check (`validate_plan`: a `$ref` may only name an ancestor) the edges. Steps in `dropped` (removed by a
live edit, kept in the list so numbers stay put) are not part of the graph.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from tether.agent.planning.refs import RefError

ID_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")


class StepShape(Protocol):
    """What the graph reads of a plan step (`tether.agent.planning.plan.PlanStep`)."""

    id: str | None
    needs: list[str] | None
    when: Any
    skill: str
    requires: Any
    on: Any


def is_graph(steps: Sequence[StepShape]) -> bool:
    """Whether a plan uses the graph's words (`needs`, `when`, or `requires` to choose one step's device);
    a plan without them is a chain."""
    return any(s.needs is not None or s.when != "success" or (s.requires is not None and s.on != "all")
               for s in steps)


def step_ids(steps: Sequence[StepShape], dropped: Collection[int] = ()) -> dict[str, int]:
    """Each id to its step's number (from 1); the first step with an id wins (duplicates are a problem)."""
    ids: dict[str, int] = {}
    for index, step in enumerate(steps):
        if step.id is not None and index not in dropped:
            ids.setdefault(step.id, index + 1)
    return ids


def label(steps: Sequence[StepShape], index: int) -> str:
    """How messages name a step: `step 3 (build)`, or `step 3 (shell.run)` when it has no id."""
    return f"step {index + 1} ({steps[index].id or steps[index].skill})"


def need_index(need: str, ids: dict[str, int], count: int) -> int | None:
    """The step (from 0) a need names, or None when it names none."""
    if need.isdigit():
        number = int(need)
        return number - 1 if 1 <= number <= count else None
    number_or_none = ids.get(need)
    return None if number_or_none is None else number_or_none - 1


def dependencies(steps: Sequence[StepShape], dropped: Collection[int] = ()) -> list[list[int]]:
    """For each step (from 0), the steps it needs (from 0); unknown needs are left out (see
    `structure_problems`). A step without `needs` needs the nearest live step listed before it."""
    ids = step_ids(steps, dropped)
    deps: list[list[int]] = []
    for index, step in enumerate(steps):
        if index in dropped:
            deps.append([])
        elif step.needs is None:
            before = [i for i in range(index) if i not in dropped]
            deps.append(before[-1:])
        else:
            found = [need_index(n, ids, len(steps)) for n in step.needs]
            deps.append(list(dict.fromkeys(i for i in found if i is not None and i not in dropped)))
    return deps


def find_cycle(deps: Sequence[Sequence[int]]) -> list[int] | None:
    """A cycle of steps (from 0, the first repeated at the end), or None when the graph has none."""
    colour = [0] * len(deps)  # 0 unseen, 1 on the path, 2 done
    for start in range(len(deps)):
        if colour[start]:
            continue
        path: list[int] = []
        stack: list[tuple[int, int]] = [(start, 0)]
        while stack:
            node, edge = stack.pop()
            if edge == 0:
                colour[node] = 1
                path.append(node)
            if edge < len(deps[node]):
                stack.append((node, edge + 1))
                nxt = deps[node][edge]
                if colour[nxt] == 1:
                    return [*path[path.index(nxt):], nxt]
                if colour[nxt] == 0:
                    stack.append((nxt, 0))
            else:
                colour[node] = 2
                path.pop()
    return None


def ancestors(deps: Sequence[Sequence[int]], index: int) -> set[int]:
    """Every step (from 0) that `index` needs, directly or through the steps it needs."""
    seen: set[int] = set()
    todo = list(deps[index])
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(deps[node])
    return seen


def dependants(deps: Sequence[Sequence[int]], index: int) -> list[int]:
    """The steps (from 0) that need `index` directly."""
    return [i for i, needs in enumerate(deps) if index in needs]


def structure_problems(steps: Sequence[StepShape], dropped: Collection[int] = ()) -> list[str]:
    """What is wrong with the graph's shape (ids, needs, cycles, conditions); empty when it is fine."""
    problems: list[str] = []
    seen: dict[str, int] = {}
    ids = step_ids(steps, dropped)
    for index, step in enumerate(steps):
        if index in dropped:
            continue
        where = label(steps, index)
        if step.id is not None:
            if not ID_PATTERN.match(step.id):
                problems.append(f"{where}: id {step.id!r} must start with a letter and hold only letters, digits, "
                                "_ and - (at most 64)")
            elif step.id in seen:
                problems.append(f"{where}: id {step.id!r} is already the id of step {seen[step.id] + 1}")
            else:
                seen[step.id] = index
        for need in step.needs or []:
            found = need_index(need, ids, len(steps))
            if found is None or found in dropped:
                known = ", ".join(sorted(ids)) or "none"
                problems.append(f"{where}: needs {need!r}, which is no step of the plan (step ids: {known}; a "
                                "step number also works)")
            elif found == index:
                problems.append(f"{where}: a step cannot need itself")
        condition = step.when if not isinstance(step.when, str) else None
        if condition is not None:
            try:
                target = condition.target(ids) - 1
            except RefError as exc:
                problems.append(f"{where}: when: {exc}")
            else:
                if target not in ancestors(dependencies(steps, dropped), index):
                    problems.append(f"{where}: when: {condition.ref!r} reads step {target + 1}, which this step "
                                    "does not need (directly or through the steps it needs): add it to needs")
    if not problems:
        cycle = find_cycle(dependencies(steps, dropped))
        if cycle is not None:
            around = " → ".join(steps[i].id or str(i + 1) for i in reversed(cycle))
            problems.append(f"the steps need each other in a cycle: {around} (each needs the one before it); "
                            "a plan's steps must be able to run in some order")
    return problems
