"""Hypothesis strategies for AIP frames: what a device or a server could put on the wire.

A frame is `(binary, data)`: the text (or bytes, sent as a binary WebSocket frame) exactly as sent.
The mix covers plain garbage, JSON of any shape, envelopes with every field drawn from good and bad
values, well-formed messages, mutations of well-formed frames (cut, spliced, with a character
changed), and frames just over the protocol's and the transport's size limits.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from hypothesis import strategies as st

from tether.protocol.messages import PROTOCOL_VERSION, ClientMessageType, ServerMessageType, TaskStatus
from tether.protocol.models import ResultStatus

Frame = tuple[bool, str | bytes]

# Tool names a fuzzed COMMAND may name: harmless built-ins (read-only, policy-checked) and unknown
# ones. Never a tool that starts a process or writes: the fuzzer does not run arbitrary commands.
SAFE_TOOLS = ("list_tools", "file_info", "list_dir", "no.such.tool", "shell", "")

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
texts = st.text(max_size=30)
ids = st.one_of(st.none(), texts, st.uuids().map(lambda u: u.hex))
versions = st.sampled_from([PROTOCOL_VERSION, "1.9", "1", "2.0", "0.1", "", "x.y", "\uff11.0"]) | json_values
statuses = st.sampled_from([s.value for s in TaskStatus]) | json_values
numbers = st.one_of(st.floats(allow_nan=False), st.integers(-5, 10**12), st.just(1e-300), json_values)


def envelope(kinds: list[str], fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """A frame-shaped dict: `type` mostly a real one, every other field present or not, good or bad."""
    return st.fixed_dictionaries(
        {"type": st.sampled_from(kinds) | json_values},
        optional={"protocol_version": versions, "timestamp": texts | json_values, "status": statuses,
                  "error": texts | json_values,
                  "payload": st.dictionaries(texts, json_values, max_size=4) | json_values,
                  "session_id": ids, **fields, "unexpected_field": json_values})


results = st.fixed_dictionaries(
    {"status": st.sampled_from([s.value for s in ResultStatus]) | json_values},
    optional={"error": texts, "result": json_values, "namespace": texts, "call_id": ids, "bogus": json_values})

registration = st.fixed_dictionaries(
    {"instance_id": st.just("fuzz-instance") | texts},
    optional={"name": st.sampled_from([None, "fuzz-pre", "someone-else", ""]) | json_values,
              "profile": st.fixed_dictionaries({}, optional={"tags": st.lists(texts, max_size=3) | json_values,
                                                             "capabilities": st.lists(texts, max_size=3),
                                                             "sandbox": texts | json_values,
                                                             "os": st.dictionaries(texts, json_values, max_size=2),
                                                             "gpu": json_values}) | json_values,
              "finished_call_ids": st.lists(texts, max_size=3) | json_values})

events = st.fixed_dictionaries({"kind": texts | json_values},
                               optional={"response_id": ids, "call_id": ids, "data": json_values})

client_dicts = envelope([t.value for t in ClientMessageType], {
    "client_id": ids, "prev_response_id": ids,
    "action_results": st.lists(results, max_size=3) | json_values,
    "payload": registration | events | st.fixed_dictionaries({"running": json_values}) | json_values,
})

commands = st.fixed_dictionaries(
    {"tool_name": st.sampled_from(SAFE_TOOLS)},
    optional={"parameters": st.fixed_dictionaries({}, optional={"path": st.sampled_from([".", "/", "x", "../.."])})
              | st.dictionaries(texts, json_values, max_size=3) | json_values,
              "tool_type": st.sampled_from(["data_collection", "action", "other"]) | json_values,
              "call_id": ids, "timeout": numbers, "approved_by": ids})

server_dicts = envelope([t.value for t in ServerMessageType], {
    "response_id": st.uuids().map(lambda u: u.hex) | ids,
    "actions": st.lists(commands, max_size=4) | json_values,
    "timeout": numbers, "early_exit": st.booleans() | json_values,
    "task_name": ids, "agent_name": ids, "process_name": ids, "root_name": ids,
})


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]]) -> str:
    """A well-formed-looking frame, then cut, spliced or with one character changed."""
    text = json.dumps(draw(base), ensure_ascii=draw(st.booleans()))
    how = draw(st.sampled_from(["cut", "insert", "replace", "delete"]))
    at = draw(st.integers(0, len(text)))
    if how == "cut":
        return text[:at]
    if how == "delete":
        return text[:at] + text[at + 1:]
    char = draw(st.sampled_from(list('{}[]":,\\0aé\x00\n ')) | st.characters(exclude_categories=["Cs"]))
    return text[:at] + char + text[at + (how == "replace"):]


def padded(kind: str, size: int) -> str:
    """A frame of `type` kind whose encoded size is `size` bytes (JSON padding in `error`)."""
    head = json.dumps({"type": kind, "error": ""})
    return head[:-2] + '"' + "x" * max(0, size - len(head)) + '"}'


def frames(dicts: st.SearchStrategy[dict[str, Any]], well_formed: st.SearchStrategy[str], kind: str,
           limit: int) -> st.SearchStrategy[Frame]:
    """Every kind of frame, text or binary; `limit` is the protocol's frame limit (the transport's is twice that)."""
    as_text = st.one_of(
        st.text(max_size=60),
        json_values.map(json.dumps),
        dicts.map(lambda d: json.dumps(d)),
        dicts.map(lambda d: json.dumps(d, ensure_ascii=False)),
        well_formed,
        mutated(dicts),
        st.sampled_from([limit, limit + 1, 2 * limit - 16, 2 * limit + 1]).map(lambda n: padded(kind, n)),
    )
    binary = st.one_of(st.binary(max_size=60), as_text.map(lambda t: t.encode("utf-8", "surrogatepass")))
    return st.one_of(as_text.map(lambda t: (False, t)), binary.map(lambda b: (True, b)))


def as_text(frame: Frame) -> str:
    """What the receiving side decodes: a binary frame is read as UTF-8 with replacement characters."""
    _, data = frame
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def wire_size(frame: Frame) -> int:
    _, data = frame
    return len(data) if isinstance(data, bytes) else len(data.encode("utf-8", "surrogatepass"))


def new_id() -> str:
    return uuid.uuid4().hex
