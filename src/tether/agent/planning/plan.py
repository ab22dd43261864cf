"""The plan: a list of skill calls, written by hand (`tether run --plan plan.yaml`) or by the planner.

A skill is a tool name a device offers (`shell.run`, `browser.act`, `ui.findAndClick`, `read_file`, …);
`args` are that tool's arguments; `device` names the device a step must run on (None: any device that
has the skill). `validate_plan` checks a plan against the tools the devices offer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tether.agent.planning.refs import iter_refs, ref_problems
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
    requires: DeviceRequirements | None = Field(default=None, description="with on: all, which devices")


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
        try:
            steps.append(PlanStep.model_validate(dict(raw)))
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
            raise PlanError(f"{path}: not valid YAML: {exc}") from None
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
                  first: int = 0, earlier: list[ToolInfo | None] | None = None) -> list[str]:
    """The problems with `plan` given the tools each device offers (key None: the default device).

    A step naming a device must use a skill that device has; a step without a device uses the
    default device (key None) when there is one, otherwise any device that has the skill. `observe`
    may only be the last step. References (`{"$ref": "steps.N.result..."}`) must name an earlier
    step and fit its tool's output schema. When the plan continues one already run (`first` steps
    before it, running `earlier` tools), step numbers in messages and references count those too.
    """
    problems: list[str] = []
    validators: dict[int, Any] = {}
    devices = sorted(name for name in tools if name is not None)
    ran: list[ToolInfo | None] = list(earlier or [None] * first)
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
        problems.extend(f"{label}: bad reference at {p}" for p in ref_problems(step.args, index, ran, observe_at))
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
