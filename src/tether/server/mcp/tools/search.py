"""`find_tools`: the gateway's search over the device tools a client reaches, and progressive listing.

A fleet of 1,000 devices with 13 tools each would hand a client 13,000 tools. Past the server setting
`mcp_progressive_over` (tools the client reaches; 0: never), `tools/list` lists only the fleet and task
tools and `find_tools`; a client finds a device's tool by words and calls it by the name the search
returned (a call resolves through the whole fleet index, not the listing, with the same refusals).

What a search sees is exactly what `tools/list` would list for the same request: `FleetIndex.listed` with the
request's filter (the URL's `?devices=` within the token's scope, `ScopedFilter`), narrowed further by the
search's own `devices` argument. Nothing outside the token's scope is ever scored or named.

Score (lexical, per tool; documented in docs/gateway.md): the query is cut into lowercase words (runs of
letters and digits). Each word adds the best of: 8 if it equals a word of the tool's name (`shell.run` has
`shell`, `run`), 5 if it is inside the tool's name, 6 if it equals the device's name or a word of it, 3 if it is
inside the device's name, 4 if it equals one of the device's tags, 3 if it is a word of the title, 1 if it is
a word of the description. A tool matching no word is left out. Tools are ranked by how many of the query's
words they match, then by score, then by listed name.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from typing import Any

import mcp_types as types

from tether.protocol.models import ToolInfo
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.mcp.listing import BadFilter, DeviceFilter, DeviceTool, FleetIndex
from tether.server.mcp.tools.translate import client_safe_schema

NAME = "find_tools"
DEFAULT_LIMIT = 20
MAX_LIMIT = 100
MAX_QUERY = 500  # characters of a query worth reading
_WORD = re.compile(r"[a-z0-9]+")

DESCRIPTION = (
    "Search the fleet's device tools by words (tool name, title, description, device name and tags) and get "
    "each match's name to call with tools/call, its device, description and input schema. When the fleet "
    "has more tools than the server lists at once, tools/list lists only the fleet tools and this one: find "
    "a device's tools here, then call them by the returned name.")

INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "description": "words to look for, e.g. 'read file lab-3'"},
        "devices": {"type": "array", "items": {"type": "string"}, "maxItems": 100,
                    "description": "only these devices: names or globs (* ? [...])"},
        "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT},
    },
    "required": ["query"],
    "additionalProperties": False,
}

OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tools": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "description": "the name to call it by (tools/call)"},
            "device": {"type": "string"}, "tool": {"type": "string"}, "title": {"type": ["string", "null"]},
            "description": {"type": "string"}, "inputSchema": {"type": "object"}, "score": {"type": "integer"}},
            "required": ["name", "device", "tool", "description", "inputSchema", "score"]}},
        "matched": {"type": "integer", "description": "how many tools matched (more than listed past limit)"},
    },
    "required": ["tools", "matched"],
}


def words(text: str | None) -> set[str]:
    """The lowercase words (runs of letters and digits) of `text`."""
    return set(_WORD.findall(text.lower())) if text else set()


@dataclass(frozen=True)
class Query:
    """A checked `find_tools` call: its words, device narrowing and limit."""

    words: tuple[str, ...]
    devices: DeviceFilter
    limit: int

    @classmethod
    def parse(cls, arguments: dict[str, Any]) -> Query:
        """The query of `arguments`; ValueError saying what is wrong (an unknown argument, no words, a bad
        device pattern, a limit outside 1..100)."""
        unknown = set(arguments) - {"query", "devices", "limit"}
        if unknown:
            raise ValueError(f"unknown argument(s): {', '.join(sorted(unknown))}")
        query = arguments.get("query")
        if not isinstance(query, str) or not words(query[:MAX_QUERY]):
            raise ValueError("query must be a string with at least one word (letters or digits)")
        devices = arguments.get("devices")
        if devices is not None and (not isinstance(devices, list) or not all(isinstance(d, str) for d in devices)):
            raise ValueError("devices must be a list of device names or globs")
        limit = arguments.get("limit", DEFAULT_LIMIT)
        if type(limit) is not int or not 1 <= limit <= MAX_LIMIT:
            raise ValueError(f"limit must be a whole number from 1 to {MAX_LIMIT}")
        try:
            narrow = DeviceFilter(None) if not devices else DeviceFilter.parse(",".join(devices))
        except BadFilter as exc:
            raise ValueError(str(exc)) from None
        return cls(tuple(sorted(words(query[:MAX_QUERY]))), narrow, limit)


def _tool_part(query: tuple[str, ...], info: ToolInfo) -> tuple[int, ...]:
    """Each query word's best score on the tool itself: its name, title and description."""
    name, name_words, title_words, text_words = (info.name.lower(), words(info.name), words(info.title),
                                                 words(info.description))
    return tuple(max(8 if word in name_words else 5 if word in name else 0, 3 if word in title_words else 0,
                     1 if word in text_words else 0) for word in query)


def _device_part(query: tuple[str, ...], device: str, tags: set[str]) -> tuple[int, ...]:
    """Each query word's best score on the device: its name and tags."""
    lowered, device_words = device.lower(), words(device)
    return tuple(max(6 if word == lowered or word in device_words else 3 if word in lowered else 0,
                     4 if word in tags else 0) for word in query)


def _combined(tool: tuple[int, ...], device: tuple[int, ...]) -> tuple[int, int]:
    """(how many query words match, score) of a tool on a device."""
    best = [max(a, b) for a, b in zip(tool, device, strict=True)]
    return sum(1 for b in best if b), sum(best)


def find_tools(index: FleetIndex, registry: DeviceRegistry, keep: DeviceFilter, query: Query) -> dict[str, Any]:
    """The `find_tools` answer: the best `query.limit` tools among those `keep` admits (the request's own
    listing filter, the token's scope included) and `query.devices` admits, each with the name `tools/call`
    takes and its input schema as `tools/list` would give it. Each part of the score is computed once per
    distinct tool text and once per device (a fleet's devices mostly share their tools)."""
    scored: list[tuple[int, int, str, DeviceTool]] = []
    devices: dict[str, tuple[int, ...] | None] = {}
    texts: dict[tuple[str, str | None, str], tuple[int, ...]] = {}
    sums: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, int]] = {}
    for tool in index.listed(keep):
        device = devices.get(tool.device, ())
        if device == ():
            record = registry.get(tool.device)
            device = devices[tool.device] = _device_part(query.words, tool.device, {
                t.lower() for t in record.tags} if record else set()) if query.devices.admits(tool.device) else None
        if device is None:
            continue
        info = tool.info
        key = (info.name, info.title, info.description)
        part = texts.get(key)
        if part is None:
            part = texts[key] = _tool_part(query.words, info)
        both = sums.get((part, device))
        if both is None:
            both = sums[(part, device)] = _combined(part, device)
        if both[0]:
            scored.append((-both[0], -both[1], tool.name, tool))
    best = heapq.nsmallest(query.limit, scored, key=lambda row: row[:3])
    rows = [{"name": tool.name, "device": tool.device, "tool": tool.info.name, "title": tool.info.title,
             "description": tool.info.description, "inputSchema": client_safe_schema(tool.info.input_schema),
             "score": -score} for _, score, _, tool in best]
    return {"tools": rows, "matched": len(scored)}


def progressive(listed: int, over: int) -> bool:
    """Whether a client reaching `listed` device tools gets the short listing (`over` 0: never)."""
    return over > 0 and listed > over


def search_tool() -> types.Tool:
    """`find_tools` as `tools/list` lists it (only in progressive mode; callable always)."""
    return types.Tool(name=NAME, description=DESCRIPTION, input_schema=INPUT_SCHEMA, output_schema=OUTPUT_SCHEMA,
                      annotations=types.ToolAnnotations(read_only_hint=True, destructive_hint=False))
