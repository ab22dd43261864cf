"""Live edits of a running graph plan: add steps, remove steps that have not started, add needs.

An edit is checked whole against the graph as it would be after it (`validate_plan` with the removed
steps dropped: ids, needs, cycles, references, skills, arguments) and applied at once, or refused with
every reason (`EditRefused`). Steps are never renumbered: a removed step stays in the list, marked
`removed`, so references and records by number keep their meaning.

`replacement` builds the edit a branch's re-plan makes: a part of new steps replaces one step (a
failed one, or an `observe` point). In the part, a step without `needs` follows the step before it,
the first one the replaced step's needs; a new step with the id of a step that has not started
replaces that step (and a new step may take the id of the replaced step itself, so references to it read
the new one); and every step that has not started and needed the replaced one needs the part's
last steps (its sinks) instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tether.agent.planning.graph import dependencies, need_index, step_ids
from tether.agent.planning.plan import Plan, PlanStep, validate_plan
from tether.errors import AgentError
from tether.protocol.models import ToolInfo

PENDING = "pending"
REMOVED = "removed"
REPLACED = "replaced"
GONE = frozenset({REMOVED, REPLACED})  # no longer part of the graph (kept in the list: numbers stay put)


class EditRefused(AgentError, ValueError):
    """An edit that would leave a bad graph, or touches steps that have started; `problems` says why."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("the edit was refused: " + "; ".join(problems))
        self.problems = problems


class GraphEdit(BaseModel):
    """Steps to add (appended, numbered on from the plan's end), steps to remove (ids or numbers of steps
    that have not started) and needs to add to steps that have not started (by id or number)."""

    model_config = ConfigDict(extra="forbid")

    add: list[PlanStep] = Field(default_factory=list)
    remove: list[str] = Field(default_factory=list)
    add_needs: dict[str, list[str]] = Field(default_factory=dict)
    rewire: dict[str, list[str]] = Field(default_factory=dict, description=(
        "a step (id or number) → the steps that take its place in the needs of every step not started"))
    replace: str | None = Field(default=None, description=(
        "a step that ran (its number) that leaves the graph, `replaced`: its id passes to a new step that takes "
        "it, so references to it read the new step"))

    def summary(self) -> dict[str, Any]:
        """What the task's log shows of the edit."""
        return {"add": [s.model_dump(mode="json", exclude_defaults=True) for s in self.add],
                "remove": self.remove, "add_needs": self.add_needs, "rewire": self.rewire, "replace": self.replace}


def apply_edit(plan: Plan, states: Sequence[str], edit: GraphEdit,
               tools: Mapping[str | None, list[ToolInfo]]) -> tuple[Plan, list[str]]:
    """(the new plan, the new step states) after `edit`, or `EditRefused` with every reason."""
    steps = list(plan.steps)
    new_states = list(states) + [PENDING] * (len(steps) - len(states))
    dropped = {i for i, s in enumerate(new_states) if s in GONE}
    problems: list[str] = []
    replaced: int | None = None
    if edit.replace is not None:
        replaced = need_index(edit.replace, step_ids(steps, dropped), len(steps))
        if replaced is None or replaced in dropped or new_states[replaced] == PENDING:
            problems.append(f"replace {edit.replace!r}: only a step that ran can be replaced")
        else:
            new_states[replaced] = REPLACED
            dropped.add(replaced)
    ids = step_ids(steps, dropped)

    def pending(name: str, what: str) -> int | None:
        index = need_index(name, ids, len(steps))
        if index is None or index in dropped:
            problems.append(f"{what} {name!r}: no such step")
            return None
        if new_states[index] != PENDING:
            problems.append(f"{what} {name!r}: step {index + 1} has already {new_states[index]}; only a step that "
                            "has not started can be changed")
            return None
        return index

    for name in edit.remove:
        index = pending(name, "remove")
        if index is not None:
            new_states[index] = REMOVED
            dropped.add(index)
    deps = dependencies(steps, dropped - {replaced} if edit.replace is not None and replaced is not None else dropped)
    for name, more in edit.add_needs.items():
        index = pending(name, "add_needs to")
        if index is not None:
            steps[index] = steps[index].model_copy(update={"needs": [*(str(d + 1) for d in deps[index]), *more]})
    for name, instead in edit.rewire.items():
        old = int(name) - 1 if name.isdigit() and 0 < int(name) <= len(steps) else need_index(name, ids, len(steps))
        if old is None:
            problems.append(f"rewire {name!r}: no such step")
            continue
        for index, needs in enumerate(deps):
            if old in needs and new_states[index] == PENDING and index not in dropped:
                kept = [str(d + 1) for d in needs if d != old]
                steps[index] = steps[index].model_copy(update={"needs": list(dict.fromkeys([*kept, *instead]))})
    steps += edit.add
    new_states += [PENDING] * len(edit.add)
    if problems:
        raise EditRefused(problems)
    candidate = Plan(steps=steps, answer=plan.answer)
    problems = validate_plan(candidate, tools, dropped=frozenset(dropped))
    if problems:
        raise EditRefused(problems)
    return candidate, new_states


def replacement(plan: Plan, states: Sequence[str], index: int, part: Sequence[PlanStep], *,
                replace: bool = True) -> GraphEdit:
    """The edit that replaces step `index` (from 0) by `part` (see the module docstring); `replace` False
    keeps the step in the graph (an observation point, which ended)."""
    dropped = {i for i, s in enumerate(states) if s in GONE}
    deps = dependencies(plan.steps, dropped)
    first = len(plan.steps)
    ids = step_ids(plan.steps, dropped)
    remove = [s.id for s in part if s.id is not None and s.id in ids
              and states[ids[s.id] - 1] == PENDING and ids[s.id] - 1 != index]
    added: list[PlanStep] = []
    for offset, step in enumerate(part):
        needs = step.needs
        if needs is None:
            needs = [str(first + offset)] if offset else [str(d + 1) for d in deps[index]]
        added.append(step.model_copy(update={"needs": needs}))
    needed = {n for s in added for n in (s.needs or [])}
    sinks = [s.id or str(first + k + 1) for k, s in enumerate(added)
             if (s.id or str(first + k + 1)) not in needed and str(first + k + 1) not in needed]
    instead = sinks if added else [str(d + 1) for d in deps[index]]
    return GraphEdit(add=added, remove=remove, rewire={str(index + 1): instead},
                     replace=str(index + 1) if replace else None)
