"""A JSON schema as a llama.cpp GBNF grammar, for servers that constrain output by `grammar` only.

`schema_to_gbnf` covers what tether's own schemas use: objects with properties (in their order,
required ones first), arrays, strings, numbers, integers, booleans, null, `enum`, `const`, `anyOf` /
`oneOf` and type lists; a schema with no type (or an object without properties) allows any JSON value
of that kind. Keywords that only narrow a value (lengths, patterns, bounds) are not enforced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

_BASE = {
    "ws": r"([ \t\n] [ \t]*)?",
    "string": r'"\"" ([^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" hex hex hex hex))* "\""',
    "hex": "[0-9a-fA-F]",
    "number": r'"-"? ([0-9] | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?',
    "integer": r'"-"? ([0-9] | [1-9] [0-9]*)',
    "boolean": r'"true" | "false"',
    "null": r'"null"',
    "value": "object | array | string | number | boolean | null",
    "object": r'"{" ws (string ws ":" ws value (ws "," ws string ws ":" ws value)*)? ws "}"',
    "array": r'"[" ws (value (ws "," ws value)*)? ws "]"',
}
_SCALARS = {"string", "number", "integer", "boolean", "null"}


def literal(value: Any) -> str:
    """A GBNF string literal matching exactly the JSON text of `value`."""
    return json.dumps(json.dumps(value, ensure_ascii=True, separators=(",", ":")))


def schema_to_gbnf(schema: Mapping[str, Any]) -> str:
    """The grammar (rule `root`) whose sentences are JSON values valid under `schema` (as far as the
    module docstring says). Raises `ValueError` for what it cannot express (`$ref`, `allOf`, `not`)."""
    rules: dict[str, str] = {}

    def rule(body: str) -> str:
        for name, existing in rules.items():
            if existing == body:
                return name
        name = f"r{len(rules)}"
        rules[name] = body
        return name

    def visit(spec: Any) -> str:
        if spec is True or spec == {} or spec is None:
            return "value"
        if not isinstance(spec, Mapping):
            raise ValueError(f"not a schema: {spec!r}")
        for unsupported in ("$ref", "allOf", "not"):
            if unsupported in spec:
                raise ValueError(f"{unsupported} cannot be expressed as a grammar")
        if "const" in spec:
            return rule(literal(spec["const"]))
        if "enum" in spec:
            return rule(" | ".join(literal(v) for v in spec["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in spec:
                return rule(" | ".join(visit(s) for s in spec[key]))
        kind = spec.get("type")
        if isinstance(kind, list):
            return rule(" | ".join(visit({**spec, "type": k}) for k in kind))
        if kind in _SCALARS:
            return kind
        if kind == "array":
            item = visit(spec.get("items"))
            return rule(f'"[" ws ({item} (ws "," ws {item})*)? ws "]"')
        if kind == "object" or (kind is None and "properties" in spec):
            return visit_object(spec)
        if kind is None:
            return "value"
        raise ValueError(f"unknown type {kind!r}")

    def visit_object(spec: Mapping[str, Any]) -> str:
        props: Mapping[str, Any] = spec.get("properties") or {}
        if not props:
            return "object"
        required = [k for k in props if k in set(spec.get("required") or ())]
        optional = [k for k in props if k not in required]
        pairs = {k: f"{literal(k)} ws \":\" ws {visit(props[k])}" for k in props}
        if required:
            body = ' ws "," ws '.join(pairs[k] for k in required)
            body += "".join(f' (ws "," ws {pairs[k]})?' for k in optional)
            return rule(f'"{{" ws {body} ws "}}"')
        # only optional keys: the first present one, then any of the later ones, in order
        first = ""
        for index in range(len(optional) - 1, -1, -1):
            tail = "".join(f' (ws "," ws {pairs[k]})?' for k in optional[index + 1:])
            here = f"{pairs[optional[index]]}{tail}"
            first = rule(f"{here} | {first}" if first else here)
        return rule(f'"{{" ws ({first})? ws "}}"')

    root = visit(schema)
    lines = [f"root ::= {root}"]
    lines += [f"{name} ::= {body}" for name, body in rules.items()]
    used = set(re.findall(r"\b[a-z]+\b", " ".join(rules.values()) + " " + root))
    if used & {"value", "object", "array"}:
        used |= {"value", "object", "array", "string", "number", "boolean", "null", "ws"}
    used |= {"ws", "hex"} if "string" in used else {"ws"}
    lines += [f"{name} ::= {body}" for name, body in _BASE.items() if name in used]
    return "\n".join(lines) + "\n"
