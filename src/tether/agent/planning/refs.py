"""References: a step's argument that names what an earlier step returned.

The one syntax is an object standing for a whole argument value (or any value nested in one):

    {"skill": "write_file", "args": {"file_path": "/nas/notes.txt",
                                     "content": {"$ref": "steps.1.result.content"}}}

`steps.N` counts the plan's steps from 1 (the numbers `tether log` and the planner's history show), over
the whole plan: steps kept from earlier rounds keep their numbers. After `result` comes a path into the
step's result: dotted keys and list indices (`steps.2.result.entries.0.name`, `entries[0]` also reads).
`steps.N.result` alone is the whole result. The value replaces the object as it is (a string stays a
string, a list a list); there is deliberately no text templating inside strings, since a template that
does not resolve would be sent on as literal text (the `{{steps[0].result.content}}` that reached the
nas). A string that looks like such a template is a plan problem that says to use `$ref`.

References are checked with the plan (`ref_problems`: the step exists and is earlier, the path fits the
referenced tool's output schema when it has one) and resolved just before the step runs (`resolve`);
one that does not resolve raises `RefError`, which the executor turns into a failed step for recovery.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from tether.errors import AgentError
from tether.protocol.models import ToolInfo

REF_KEY = "$ref"
MAX_DEPTH = 32
_TEMPLATE = re.compile(r"(\{\{|\$\{)\s*steps?[\[.]")
REF_PATTERN = r"^steps\.(\d+|[A-Za-z_][A-Za-z0-9_-]*)\.result((?:\.[^.\[\]]+|\[\d+\])*)$"  # a reference, whole
_PATH = re.compile(REF_PATTERN)
_PART = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]")

ERROR_CODE = "unresolved_ref"  # the marker recovery recognizes in a failed step's result


class RefError(AgentError, ValueError):
    """A reference that is malformed or does not resolve; the message says which and why."""


def is_ref(value: Any) -> bool:
    return isinstance(value, Mapping) and REF_KEY in value


def parse_ref(text: Any, ids: Mapping[str, int] | None = None) -> tuple[int, list[str | int]]:
    """(step number counted from 1, path parts) of a reference's text; `RefError` when malformed.

    A step of a graph plan may be named by its `id` (`steps.build.result.stdout`): `ids` maps each id to
    its step number; an id it does not hold (or any id without `ids`) is a `RefError` naming it."""
    if not isinstance(text, str):
        raise RefError(f"a $ref is a string like \"steps.1.result.stdout\", not {type(text).__name__}")
    match = _PATH.match(text.strip())
    if match is None:
        raise RefError(f"{text!r} is not a reference: write \"steps.N.result\" followed by keys, "
                       "e.g. \"steps.1.result.stdout\" (N counts steps from 1)")
    target = match.group(1)
    if target.isdigit():
        number = int(target)
    elif ids is not None and target in ids:
        number = ids[target]
    else:
        known = ", ".join(sorted(ids or {})) or "none"
        raise RefError(f"{text!r} names step {target!r}, and no step has that id (step ids: {known})")
    parts: list[str | int] = []
    for key, index in _PART.findall(match.group(2)):
        if index:
            parts.append(int(index))
        elif key.isdigit():
            parts.append(int(key))
        else:
            parts.append(key)
    return number, parts


def iter_refs(value: Any, where: str = "", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """(argument path, the $ref object) for every reference in `value`."""
    if depth > MAX_DEPTH:
        return
    if is_ref(value):
        yield where, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from iter_refs(item, f"{where}/{key}" if where else str(key), depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from iter_refs(item, f"{where}/{i}", depth + 1)


def iter_templates(value: Any, where: str = "", depth: int = 0) -> Iterator[str]:
    """Argument paths of strings that look like a text template naming a step (not supported)."""
    if depth > MAX_DEPTH:
        return
    if isinstance(value, str):
        if _TEMPLATE.search(value):
            yield where
    elif isinstance(value, Mapping) and not is_ref(value):
        for key, item in value.items():
            yield from iter_templates(item, f"{where}/{key}" if where else str(key), depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from iter_templates(item, f"{where}/{i}", depth + 1)


def _schema_walk(schema: Mapping[str, Any], parts: list[str | int]) -> str | None:
    """Why `parts` cannot exist in values of `schema` (None when it can, or the schema cannot tell)."""
    defs = schema.get("$defs") or schema.get("definitions") or {}
    node: Mapping[str, Any] = schema
    done: list[str] = []
    for part in parts:
        for _ in range(8):  # follow local $refs of the schema itself
            target = node.get("$ref")
            if not isinstance(target, str) or not target.startswith("#/"):
                break
            node = defs.get(target.rsplit("/", 1)[-1]) or {}
        if any(k in node for k in ("anyOf", "oneOf", "allOf")) or not node:
            return None  # too loose to judge
        kind = node.get("type")
        label = ".".join(str(p) for p in done) or "the result"
        if isinstance(part, int):
            if kind not in (None, "array") and not (isinstance(kind, list) and "array" in kind):
                return f"{label} is {kind}, not a list"
            node = node.get("items") or {}
        else:
            if kind not in (None, "object") and not (isinstance(kind, list) and "object" in kind):
                return f"{label} is {kind}, not an object with key {part!r}"
            props = node.get("properties")
            if isinstance(props, Mapping) and part in props:
                node = props[part]
            elif isinstance(props, Mapping) and node.get("additionalProperties") in (None, False):
                known = ", ".join(sorted(props)) or "none"
                return f"{label} has no key {part!r} (its keys: {known})"
            else:
                extra = node.get("additionalProperties")
                node = extra if isinstance(extra, Mapping) else {}
        done.append(str(part))
    return None


def ref_problems(args: Mapping[str, Any], index: int, earlier: list[ToolInfo | None],
                 observe_at: set[int] | None = None, *, ids: Mapping[str, int] | None = None,
                 ancestors: set[int] | None = None) -> list[str]:
    """What is wrong with the references in step `index`'s (from 0) `args`.

    `earlier[i]` is the tool step i runs (None when unknown); paths are checked against its output
    schema when it has one. A reference to an `observe` step (`observe_at`) has nothing to read. In a
    graph plan, `ids` maps step ids to numbers and `ancestors` holds the steps (from 0) that surely end
    before this one: only those may be referred to (a step on another branch may not have run yet)."""
    problems: list[str] = []
    for where in iter_templates(args):
        problems.append(f"{where}: text templates such as {{{{steps[0].result...}}}} are not resolved; "
                        'give the whole value as {"$ref": "steps.N.result.key"}')
    for where, ref in iter_refs(args):
        extra = sorted(set(ref) - {REF_KEY})
        if extra:
            problems.append(f"{where}: a $ref object has only the key $ref, not {extra}")
            continue
        try:
            number, parts = parse_ref(ref[REF_KEY], ids)
        except RefError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if ancestors is not None:
            if number - 1 not in ancestors:
                problems.append(f"{where}: {ref[REF_KEY]!r} names step {number}, which this step does not "
                                "need (directly or through the steps it needs): add it to needs")
                continue
        elif number < 1 or number > index:
            problems.append(f"{where}: {ref[REF_KEY]!r} names step {number}, but a step can only use "
                            f"steps before it (1 to {index})" if index else
                            f"{where}: {ref[REF_KEY]!r}: the first step has no earlier step to use")
            continue
        if observe_at and number - 1 in observe_at:
            problems.append(f"{where}: step {number} is an observation point and has no result")
            continue
        tool = earlier[number - 1] if number - 1 < len(earlier) else None
        if tool is not None and tool.output_schema:
            why = _schema_walk(tool.output_schema, parts)
            if why:
                problems.append(f"{where}: {ref[REF_KEY]!r} does not fit {tool.name}'s output: {why}")
    return problems


def lookup(result: Any, parts: list[str | int]) -> Any:
    """The value at `parts` in `result`; `RefError` saying where the path stops."""
    value = result
    for depth, part in enumerate(parts):
        so_far = ".".join(str(p) for p in parts[:depth]) or "the result"
        if isinstance(part, int):
            if not isinstance(value, list):
                raise RefError(f"{so_far} is {_kind(value)}, not a list")
            if part >= len(value):
                raise RefError(f"{so_far} has {len(value)} items, no item {part}")
            value = value[part]
        else:
            if not isinstance(value, Mapping):
                raise RefError(f"{so_far} is {_kind(value)}, not an object with key {part!r}")
            if part not in value:
                keys = ", ".join(sorted(map(str, value))[:20]) or "none"
                raise RefError(f"{so_far} has no key {part!r} (its keys: {keys})")
            value = value[part]
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def resolve(args: Any, results: Mapping[int, Any], depth: int = 0, ids: Mapping[str, int] | None = None) -> Any:
    """`args` with every reference replaced by the value it names.

    `results` maps step numbers (from 1) to the result of that step's successful run; a step that
    failed, was skipped or has not run is absent and its references raise `RefError`. `ids`: a graph
    plan's step ids and their numbers (see `parse_ref`)."""
    if depth > MAX_DEPTH:
        raise RefError("the arguments are nested too deeply")
    if is_ref(args):
        text = args[REF_KEY]
        number, parts = parse_ref(text, ids)
        if number not in results:
            raise RefError(f"the reference {text!r} does not resolve: step {number} has no result "
                           "(it did not run or did not succeed)")
        try:
            return lookup(results[number], parts)
        except RefError as exc:
            raise RefError(f"the reference {text!r} does not resolve: {exc}") from None
    if isinstance(args, Mapping):
        return {key: resolve(item, results, depth + 1, ids) for key, item in args.items()}
    if isinstance(args, list):
        return [resolve(item, results, depth + 1, ids) for item in args]
    return args


def has_refs(args: Any) -> bool:
    return next(iter_refs(args), None) is not None
