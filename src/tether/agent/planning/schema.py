"""A tool's argument schema in the form strict structured output accepts (OpenAI's strict mode; llama.cpp turns
it into a grammar), and the `{"$ref": ...}` an argument may be instead of a value."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

REF_ARG: dict[str, Any] = {"type": "object", "properties": {"$ref": {"type": "string"}}, "required": ["$ref"],
                           "additionalProperties": False}
_STRICT_KEYS = ("type", "enum", "const", "description")


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
