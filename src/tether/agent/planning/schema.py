"""The JSON schema a plan is asked for under (`plan_schema`: one branch per skill offered, with that skill's own
arguments) and the strict form of a tool's argument schema that servers enforcing schemas accept (`strict_schema`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tether.agent.planning.device_view import DeviceView
from tether.agent.planning.graph import ID_PATTERN
from tether.agent.planning.plan import OBSERVE, Plan
from tether.protocol.models import ToolInfo

REF_ARG: dict[str, Any] = {"type": "object", "properties": {"$ref": {"type": "string"}}, "required": ["$ref"],
                            "additionalProperties": False}
_STRICT_KEYS = ("type", "enum", "const", "description")
# A step's place in a graph plan, in strict form (every key sent, null when not wanted): see planning/graph.py
_CONDITION: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["ref", "equals", "contains", "matches"],
    "properties": {"ref": {"type": "string"}, "equals": {"type": ["string", "number", "boolean", "null"]},
                   "contains": {"type": ["string", "null"]}, "matches": {"type": ["string", "null"]}}}
# ids in the form planning/graph.py accepts: a server that enforces the schema (llama.cpp turns it into a
# grammar) then cannot let a small model run on inside an id until `max_tokens` cuts the reply off
_ID: dict[str, Any] = {"type": "string", "pattern": ID_PATTERN.pattern}
_GRAPH_KEYS: dict[str, Any] = {
    "id": {**_ID, "type": ["string", "null"]},
    "needs": {"type": ["array", "null"], "items": _ID},
    "when": {"anyOf": [{"type": "string", "enum": ["success", "failure", "always"]}, _CONDITION, {"type": "null"}]},
}


def strict_schema(spec: Any) -> dict[str, Any] | None:
    """`spec` in the form OpenAI's strict mode accepts (every property required, optional ones made
    nullable, `additionalProperties: false`, no keywords it rejects), or None when it cannot be put
    so (a free-form object or map, `$ref`, `allOf`, `not`). An optional property that cannot is left out."""
    if not isinstance(spec, Mapping) or any(k in spec for k in ("$ref", "allOf", "not")):
        return None
    for key in ("anyOf", "oneOf"):
        if key in spec:
            branches = [strict_schema(s) for s in spec[key]]
            return None if any(b is None for b in branches) else {"anyOf": branches}
    out: dict[str, Any] = {k: spec[k] for k in _STRICT_KEYS if k in spec}
    kind = spec.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is None and "enum" not in spec and "const" not in spec:
        return None
    if "array" in kinds:
        items = strict_schema(spec.get("items"))
        if items is None:
            return None
        out["items"] = items
    if "object" in kinds:
        props: Mapping[str, Any] = spec.get("properties") or {}
        if not props:
            return None
        required = set(spec.get("required") or ())
        converted: dict[str, Any] = {}
        for name, prop in props.items():
            strict = strict_schema(prop)
            if strict is None:
                if name in required:
                    return None
                continue
            converted[name] = strict if name in required else _nullable(strict)
        out.update(properties=converted, required=list(converted), additionalProperties=False)
    return out


def _nullable(spec: dict[str, Any]) -> dict[str, Any]:
    if "anyOf" in spec:
        return {"anyOf": [*spec["anyOf"], {"type": "null"}]}
    out = dict(spec)
    kind = out.get("type")
    if isinstance(kind, str):
        out["type"] = [kind, "null"]
    elif isinstance(kind, list) and "null" not in kind:
        out["type"] = [*kind, "null"]
    if "enum" in out and None not in out["enum"]:
        out["enum"] = [*out["enum"], None]
    if "const" in out:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def plan_schema(devices: Mapping[str, DeviceView], *, graph: bool = True) -> tuple[dict[str, Any], bool]:
    """The plan's JSON schema for these devices and whether it is strict: `steps` items are one branch
    per skill (`anyOf`, as strict mode allows no `oneOf`), each naming its skill as a one-value enum with
    that skill's own argument schema (each argument may also be a `{"$ref": ...}` to an earlier step's
    result) and the devices that have it; plus `observe`. Not strict when a skill's required arguments
    cannot be put in strict form (that skill's arguments are then any object). `graph` False leaves out
    a step's `id`, `needs` and `when` (a chain)."""
    graph_keys = _GRAPH_KEYS if graph else {}
    several = len(devices) > 1
    owners: dict[str, list[str]] = {}
    skills: dict[str, ToolInfo] = {}
    for name, view in devices.items():
        for tool in view.tools:
            skills.setdefault(tool.name, tool)
            owners.setdefault(tool.name, []).append(name)
    strict = True
    branches: list[dict[str, Any]] = []

    def branch(skill: str, args: dict[str, Any], device: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "additionalProperties": False,
                "properties": {"skill": {"type": "string", "enum": [skill]}, "args": args,
                               "description": {"type": "string"}, "device": device, **graph_keys},
                "required": ["skill", "args", "description", "device", *graph_keys]}

    for skill, tool in skills.items():
        given = tool.input_schema or {}
        converted: dict[str, Any] | None
        if given.get("properties"):
            converted = strict_schema(given)
        elif given.get("additionalProperties") in (None, False):  # no arguments
            converted = {"type": "object", "properties": {}, "required": [], "additionalProperties": False}
        else:  # any arguments: not expressible strictly
            converted = None
        args: dict[str, Any]
        if converted is None:
            strict = False
            args = {"type": "object"}
        else:
            props: dict[str, Any] = converted["properties"]
            args = {**converted, "properties": {k: {"anyOf": [*v["anyOf"], REF_ARG]} if "anyOf" in v
                                                else {"anyOf": [v, REF_ARG]} for k, v in props.items()}}
        device = {"type": ["string", "null"], "enum": [*owners[skill], None]} if several else {"type": "null"}
        branches.append(branch(skill, args, device))
    observe_args = {"type": "object", "properties": {"note": {"type": ["string", "null"]}}, "required": ["note"],
                    "additionalProperties": False}
    branches.append(branch(OBSERVE, observe_args, {"type": "null"}))
    schema = {"type": "object", "additionalProperties": False, "required": ["steps", "answer"],
              "properties": {"steps": {"type": "array", "items": {"anyOf": branches}},
                             "answer": {"type": ["string", "null"]}}}
    return schema, strict


def _without_null_options(plan: Plan, devices: Mapping[str, DeviceView]) -> Plan:
    """The plan with arguments that are null but optional left out (strict mode sends every argument,
    the ones not wanted as null)."""
    required: dict[str, set[str]] = {}
    for view in devices.values():
        for tool in view.tools:
            required.setdefault(tool.name, set((tool.input_schema or {}).get("required") or ()))
    steps = []
    for step in plan.steps:
        needed = required.get(step.skill, set())
        args = {k: v for k, v in step.args.items() if v is not None or k in needed}
        steps.append(step if args == step.args else step.model_copy(update={"args": args}))
    return plan.model_copy(update={"steps": steps})


def compact_schema(schema: Mapping[str, Any]) -> str:
    """The tool's arguments in as few tokens as carry them: `name: type (default) *required`."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    if not props:
        return "no arguments"
    out = []
    for name, spec in props.items():
        text = f"{name}{'*' if name in required else ''}: {_type_of(spec)}"
        if "default" in spec and spec["default"] not in (None, [], {}, ""):
            text += f" = {json.dumps(spec['default'])}"
        if spec.get("description"):
            text += f" ({spec['description']})"
        out.append(text)
    return "; ".join(out)


def _type_of(spec: Mapping[str, Any]) -> str:
    if "enum" in spec:
        return "|".join(json.dumps(v) for v in spec["enum"])
    if "anyOf" in spec:
        kinds = [_type_of(s) for s in spec["anyOf"] if s.get("type") != "null"]
        return "|".join(kinds) + ("?" if any(s.get("type") == "null" for s in spec["anyOf"]) else "")
    kind = spec.get("type", "any")
    if isinstance(kind, list):
        return "|".join(kind)
    if kind == "array":
        return f"{_type_of(spec.get('items') or {})}[]"
    if kind == "object" and "additionalProperties" in spec and isinstance(spec["additionalProperties"], dict):
        return f"map<{_type_of(spec['additionalProperties'])}>"
    return str(kind)
