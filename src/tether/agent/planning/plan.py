"""The plan: skill calls, written by hand (`tether run --plan plan.yaml`) or by the planner.

A skill is a tool name a device offers (`shell.run`, `browser.act`, `ui.findAndClick`, `read_file`, …);
`args` are that tool's arguments; `device` names the device a step must run on (None: any device that
has the skill). A plan is a list (a chain: each step after the one before it) or a graph: steps with
an `id`, `needs: [ids]` and `when` (`tether.agent.planning.graph`, `tether.agent.planning.when`).
`validate_plan` checks a plan against the tools the devices offer and, for a graph, its shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tether.agent.planning.graph import ancestors, dependencies, is_graph, step_ids, structure_problems
from tether.agent.planning.refs import iter_refs, ref_problems
from tether.agent.planning.when import Condition, WhenWord
from tether.errors import AgentError
from tether.protocol.models import ToolInfo
from tether.protocol.profile import DeviceRequirements

OBSERVE = "observe"  # the pseudo-skill that ends a plan at an observation point


class PlanError(AgentError, ValueError):
    """A plan that cannot be read; the message names where (file, step index) and what is wrong."""


class PlanStep(BaseModel):
    model_config = ConfigDict(extra="forbid")

    skill: str = Field(..., min_length=1, description="The tool to call, e.g. shell.run")
    args: dict[str, Any] = Field(default_factory=dict, description="The tool's arguments")
    description: str = Field(default="", description="What the step does, in a few words")
    device: str | None = Field(default=None, description="The device to run on; None for any")
    on: Literal["all"] | None = Field(default=None, description=(
        "'all': the step runs on every device meeting `requires` at once (a fan-out), and its result is "
        "each device's result plus a summary"))
    requires: DeviceRequirements | None = Field(default=None, description=(
        "with on: all, which devices; without on: all and device, what the one device chosen for the step "
        "must offer (platform, tags, tools)"))
    id: str | None = Field(default=None, description="a name other steps use in needs, when and $ref")
    needs: list[str] | None = Field(default=None, description=(
        "the steps (ids, or numbers from 1) that must end before this one; absent: the step before it; "
        "[]: none (it starts at once)"))
    when: WhenWord | Condition = Field(default="success", description=(
        "success: its needs succeeded; failure: one of them failed; always: they ended; or a condition "
        "{ref, equals|contains|matches} on an earlier result"))


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: list[PlanStep] = Field(default_factory=list)
    answer: str | None = Field(default=None, max_length=4000,
                               description="the reply to the user once every step succeeded, when the planner "
                                           "knows it already (it saves the answer's LLM call)")


# The JSON schema the planner asks the LLM to answer under.
PLAN_JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "skill": {"type": "string"},
                    "args": {"type": "object"},
                    "description": {"type": "string"},
                    "device": {"type": ["string", "null"]},
                    "on": {"enum": ["all", None]},
                    "requires": {"type": ["object", "null"]},
                    "id": {"type": ["string", "null"]},
                    "needs": {"type": ["array", "null"], "items": {"type": "string"}},
                    "when": {"type": ["string", "object"]},
                },
                "required": ["skill", "args"],
                "additionalProperties": False,
            },
        },
        "answer": {"type": ["string", "null"]},
    },
    "required": ["steps"],
    "additionalProperties": False,
}


def _describe_validation_error(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"])
        parts.append(f"{where}: {item['msg']}" if where else item["msg"])
    return "; ".join(parts)


def plan_from_data(data: Any, source: str = "plan") -> Plan:
    """A plan from parsed JSON/YAML: a list of steps or `{"steps": [...]}`; errors name the step index."""
    answer = None
    if isinstance(data, Mapping) and "steps" in data:
        extra = sorted(set(data) - {"steps", "answer"})
        if extra:
            raise PlanError(f"{source}: unexpected top-level keys {extra}; expected only 'steps' (and 'answer')")
        answer = data.get("answer")
        if answer is not None and not isinstance(answer, str):
            raise PlanError(f"{source}: answer: a plan's answer is text, not {type(answer).__name__}")
        data = data["steps"]
    if data is None:
        data = []
    if not isinstance(data, list):
        raise PlanError(f"{source}: a plan is a list of steps (or {{steps: [...]}}), not {type(data).__name__}")
    steps: list[PlanStep] = []
    for index, raw in enumerate(data):
        if not isinstance(raw, Mapping):
            raise PlanError(f"{source}: step {index + 1}: a step is a mapping with skill and args, "
                            f"not {type(raw).__name__}")
        raw = dict(raw)
        when = raw.get("when")
        if when is None:  # strict JSON-schema modes send every key, the unwanted ones as null
            raw.pop("when", None)
        elif isinstance(when, Mapping):
            raw["when"] = {k: v for k, v in when.items() if v is not None}
        try:
            steps.append(PlanStep.model_validate(raw))
        except ValidationError as exc:
            raise PlanError(f"{source}: step {index + 1}: {_describe_validation_error(exc)}") from None
    return Plan(steps=steps, answer=answer or None)


def load_plan_file(path: str | Path) -> Plan:
    """Read a plan written by hand (.yaml/.yml or .json; other suffixes are tried as YAML)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"{path}: cannot read the plan file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        from tether import yaml12

        raise PlanError(f"{path}: not UTF-8 text: {yaml12.where_and_why(exc)}") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path}: not valid JSON: {exc}") from None
    else:
        import yaml

        from tether import yaml12

        try:
            data = yaml12.safe_load(text)
        except yaml.YAMLError as exc:
            raise PlanError(f"{path}: not valid YAML: {yaml12.where_and_why(exc)}") from None
    return plan_from_data(data, str(path))


def find_tool(tools: Iterable[ToolInfo], skill: str) -> ToolInfo | None:
    for tool in tools:
        if tool.name == skill:
            return tool
    return None


def check_args(tool: ToolInfo, args: dict[str, Any], validators: dict[int, Any] | None = None) -> list[str]:
    """What is wrong with `args` for `tool`, per its input schema (empty when fine).

    `validators` is a cache the caller owns (one per plan check): building a validator costs far
    more than using one, and a plan calls the same few tools again and again. A value that is a
    reference to an earlier step (`{"$ref": ...}`) is only known at run time: errors at it are not
    counted here (the resolved arguments are checked by the tool itself)."""
    import jsonschema  # here, not at the top: the server's start (and its /health) does not need it

    refs = {where for where, _ in iter_refs(args)}
    try:
        validator = validators.get(id(tool)) if validators is not None else None
        if validator is None:
            validator = jsonschema.validators.validator_for(tool.input_schema)(tool.input_schema)
            if validators is not None:
                validators[id(tool)] = validator
        errors = sorted(validator.iter_errors(args), key=lambda e: list(e.absolute_path))
    except jsonschema.SchemaError as exc:
        return [f"the tool {tool.name} has an invalid input schema: {exc.message}"]
    out = []
    for error in errors:
        where = "/".join(str(p) for p in error.absolute_path)
        if any(where == r or where.startswith(r + "/") for r in refs):
            continue
        out.append(f"{where}: {error.message}" if where else error.message)
    return out


def validate_plan(plan: Plan, tools: Mapping[str | None, list[ToolInfo]], *, allow_empty: bool = False,
                  first: int = 0, earlier: list[ToolInfo | None] | None = None,
                  dropped: frozenset[int] = frozenset()) -> list[str]:
    """The problems with `plan` given the tools each device offers (key None: the default device).

    A step naming a device must use a skill that device has; a step without a device uses the
    default device (key None) when there is one, otherwise any device that has the skill. `observe`
    may only be the last step. References (`{"$ref": "steps.N.result..."}`) must name an earlier
    step and fit its tool's output schema. When the plan continues one already run (`first` steps
    before it, running `earlier` tools), step numbers in messages and references count those too.

    A graph plan (`tether.agent.planning.graph.is_graph`) is checked whole (`first` and `earlier` do not
    apply): its shape (ids, needs, cycles, conditions), and references only to steps it surely follows
    (ancestors); `observe` may end any branch. Steps in `dropped` (removed by a live edit) are skipped.
    """
    if is_graph(plan.steps) or dropped:
        return _validate_graph(plan, tools, dropped)
    problems: list[str] = []
    validators: dict[int, Any] = {}
    devices = sorted(name for name in tools if name is not None)
    ran: list[ToolInfo | None] = list(earlier or [None] * first)
    ids = {name: number + first for name, number in step_ids(plan.steps).items()}
    observe_at: set[int] = set()
    if not plan.steps and not allow_empty:
        problems.append("the plan has no steps")
    for offset, step in enumerate(plan.steps):
        index = first + offset
        label = f"step {index + 1} ({step.skill})"
        if step.skill == OBSERVE:
            if offset != len(plan.steps) - 1:
                problems.append(f"{label}: observe ends a plan; it must be the last step")
            elif offset == 0:
                problems.append(f"{label}: observe needs steps before it whose results to look at")
            if step.args and set(step.args) - {"note"}:
                problems.append(f"{label}: observe takes only an optional 'note'")
            observe_at.add(index)
            ran.append(None)
            continue
        problems.extend(f"{label}: bad reference at {p}"
                        for p in ref_problems(step.args, index, ran, observe_at, ids=ids))
        if step.on == "all" or step.requires is not None:
            # the fleet's devices are not among the task's: each device checks the call itself
            if step.on != "all":
                problems.append(f"{label}: requires picks the devices of on: all; add on: all")
            elif step.device is not None:
                problems.append(f"{label}: on: all runs on every matching device; it does not take device")
            ran.append(None)
            continue
        if step.device is not None:
            if step.device not in tools:
                known = ", ".join(devices) or "none"
                problems.append(f"{label}: unknown device {step.device!r} (known devices: {known})")
                continue
            candidates: list[tuple[str | None, list[ToolInfo]]] = [(step.device, tools[step.device])]
        elif None in tools:
            candidates = [(None, tools[None])]
        else:
            candidates = [(name, tools[name]) for name in devices]
        found = [(name, tool) for name, device_tools in candidates
                 if (tool := find_tool(device_tools, step.skill)) is not None]
        if not found:
            where = f"on device {step.device!r}" if step.device is not None else "on any device"
            available = sorted({t.name for _, device_tools in candidates for t in device_tools})
            problems.append(f"{label}: unknown skill {step.skill!r} {where}; "
                            f"available skills: {', '.join(available) or 'none'}")
            ran.append(None)
            continue
        ran.append(found[0][1])
        arg_problems = check_args(found[0][1], step.args, validators)
        if arg_problems and len(found) > 1:
            # several devices have the skill; the step is fine if one of them accepts the arguments
            for _, tool in found[1:]:
                if not check_args(tool, step.args, validators):
                    arg_problems = []
                    break
        problems.extend(f"{label}: bad args: {p}" for p in arg_problems)
    return problems


def _step_tool(step: PlanStep, tools: Mapping[str | None, list[ToolInfo]]) -> ToolInfo | None:
    order = [tools[step.device]] if step.device in tools else []
    order += [v for k, v in tools.items() if k != step.device]
    return next((t for device_tools in order if (t := find_tool(device_tools, step.skill)) is not None), None)


def _validate_graph(plan: Plan, tools: Mapping[str | None, list[ToolInfo]], dropped: frozenset[int]) -> list[str]:
    """`validate_plan` for a graph: its shape first; then each step as in a list, references by ancestry."""
    steps = plan.steps
    problems = structure_problems(steps, dropped)
    if not [i for i in range(len(steps)) if i not in dropped]:
        problems.append("the plan has no steps")
    if problems:
        return problems
    deps = dependencies(steps, dropped)
    ids = step_ids(steps, dropped)
    observe_at = {i for i, s in enumerate(steps) if s.skill == OBSERVE}
    ran = [None if s.skill == OBSERVE else _step_tool(s, tools) for s in steps]
    for index, step in enumerate(steps):
        if index in dropped:
            continue
        label = f"step {index + 1} ({step.id or step.skill})"
        if step.skill == OBSERVE:
            if step.args and set(step.args) - {"note"}:
                problems.append(f"{label}: observe takes only an optional 'note'")
            if not deps[index]:
                problems.append(f"{label}: observe needs steps before it whose results to look at")
            continue
        problems.extend(f"{label}: bad reference at {p}" for p in
                        ref_problems(step.args, index, ran, observe_at, ids=ids, ancestors=ancestors(deps, index)))
        # the skill and its arguments, as a list plan's step (references were checked above)
        single = step.model_copy(update={"id": None, "needs": None, "when": "success"})
        choices: Mapping[str | None, list[ToolInfo]] = tools
        if step.requires is not None and step.on != "all":
            if step.device is not None:
                problems.append(f"{label}: requires chooses a device for a step that names none; drop device "
                                "or requires")
                continue
            single = single.model_copy(update={"requires": None})
            choices = {k: v for k, v in tools.items() if k is not None}  # the device is chosen when it runs
            if not choices:
                problems.append(f"{label}: requires chooses a device among an agent server's devices; this task "
                                "runs on one device (name none)")
                continue
        for problem in validate_plan(Plan(steps=[single]), choices):
            if "bad reference at" not in problem:
                problems.append(problem.replace(f"step 1 ({step.skill})", label, 1))
    return problems
