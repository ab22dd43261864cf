"""What the gateway lists: the fleet tool `list_devices`, and every online device's tools as `DEVICE__TOOL`.

Names. MCP allows `A-Z a-z 0-9 _ . -` in a tool name (SEP-986, `mcp.shared.tool_name_validation`), so
`laptop` + `shell.run` is listed as `laptop__shell.run` unchanged. Any other character of a device or tool
name (a device may be called `me@laptop`) is written as `-XX`, the hex of each of its UTF-8 bytes. A call is
resolved through the listing itself, never by parsing the name back, so the name a client calls always
reaches the tool that was listed under it. The mapping is not one-to-one: a device registered as
`me-40laptop`, or a device `a` offering a tool `b__shell.run` beside a device `a__b`, maps to the same
name as another device's tool. Such a name is listed for NONE of them and a call of it is refused (with a
log line): letting the first one keep it would let one device take calls meant for another.

The device filter (`/mcp?devices=laptop,lab-*`, or `devices=none`) chooses whose tools a client sees, so a
fleet of 1,000 devices does not hand a client 30,000 tools; the fleet tools are listed whatever it says.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from dataclasses import dataclass
from typing import Any

from tether.errors import ServerError
from tether.protocol.models import ToolInfo
from tether.server.aip.fleet.record import DeviceRecord
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.fleet.scopes import reaches
from tether.server.store.tokens import TokenInfo

logger = logging.getLogger(__name__)

SEPARATOR = "__"
MAX_FILTER_PATTERNS = 100
_LEGAL = re.compile(r"[A-Za-z0-9_.-]")
_PATTERN = re.compile(r"^[A-Za-z0-9._@*?\[\]!-]{1,128}$")


def mcp_name(device: str, tool: str) -> str:
    """`DEVICE__TOOL` with characters MCP does not allow in a name escaped (see the module docstring)."""
    return f"{escape_name(device)}{SEPARATOR}{escape_name(tool)}"


def escape_name(text: str) -> str:
    """`text` with every character MCP does not allow in a tool name written as `-XX` (its UTF-8 bytes)."""
    if all(_LEGAL.match(c) for c in text):
        return text
    return "".join(c if _LEGAL.match(c) else "".join(f"-{b:02X}" for b in c.encode()) for c in text)


class BadFilter(ServerError, ValueError):
    """The `devices` query parameter cannot be read; the message says why."""


@dataclass(frozen=True)
class DeviceFilter:
    """Which devices' tools a client sees: all (`None`), none (empty), or those matching a name or glob."""

    patterns: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, value: str | None) -> DeviceFilter:
        if value is None or value.strip() in ("", "*", "all"):
            return cls(None)
        if value.strip() == "none":
            return cls(())
        patterns = tuple(p.strip() for p in value.split(",") if p.strip())
        if len(patterns) > MAX_FILTER_PATTERNS:
            raise BadFilter(f"devices: at most {MAX_FILTER_PATTERNS} names or patterns, not {len(patterns)}")
        for pattern in patterns:
            if not _PATTERN.match(pattern):
                raise BadFilter(f"devices: {pattern[:80]!r} is not a device name or glob (letters, digits, "
                                "'.', '_', '@', '-' and the wildcards '*', '?', '[...]')")
        return cls(patterns)

    def admits(self, device: str) -> bool:
        if self.patterns is None:
            return True
        return any(fnmatch.fnmatchcase(device, p) for p in self.patterns)


@dataclass(frozen=True)
class ScopedFilter(DeviceFilter):
    """A `DeviceFilter` that also leaves out the devices outside the token's scope: what a scoped token's
    client lists, calls and is told about (tools/list_changed) is within its devices, whatever `?devices=` says."""

    token: TokenInfo | None = None
    registry: DeviceRegistry | None = None

    @classmethod
    def of(cls, keep: DeviceFilter, token: TokenInfo, registry: DeviceRegistry) -> DeviceFilter:
        """`keep` itself for an unscoped token (nothing more to check), else `keep` within the token's scope."""
        return cls(keep.patterns, token, registry) if token.scoped else keep

    def admits(self, device: str) -> bool:
        if not super().admits(device):
            return False
        return self.token is None or self.registry is None or reaches(self.token, self.registry, device)


@dataclass(frozen=True)
class DeviceTool:
    """One listed device tool: the MCP name it goes by and what it is on its device."""

    name: str
    device: str
    info: ToolInfo


def tool_annotations(info: ToolInfo) -> dict[str, Any]:
    """The MCP annotations of a device's tool: an external server's own (`info.annotations`) as it gave them;
    for tether's tools, from the tool type: a `data_collection` tool only reads; an `action` may change things,
    so clients are told it may be destructive (the device's policy, approvals and undo journal are what
    actually bound it)."""
    if info.annotations is not None:
        return dict(info.annotations)
    read_only = info.tool_type == "data_collection"
    return {"readOnlyHint": read_only, "destructiveHint": not read_only, "openWorldHint": not read_only}


class FleetIndex:
    """The online devices' tools by MCP name, rebuilt only after the fleet changed (`invalidate`)."""

    def __init__(self, registry: DeviceRegistry) -> None:
        self.registry = registry
        self._tools: dict[str, DeviceTool] | None = None
        self._ambiguous: frozenset[str] = frozenset()

    def invalidate(self) -> None:
        self._tools = None

    def is_ambiguous(self, name: str) -> bool:
        """Whether `name` maps to tools of several devices (and so is listed for none)."""
        self.tools()
        return name in self._ambiguous

    def tools(self) -> dict[str, DeviceTool]:
        if self._tools is None:
            self._tools = self._build()
        return self._tools

    def listed(self, keep: DeviceFilter) -> list[DeviceTool]:
        admitted: dict[str, bool] = {}  # judged once per device, not per tool (a scope check looks the device up)
        for tool in self.tools().values():
            if tool.device not in admitted:
                admitted[tool.device] = keep.admits(tool.device)
        return [t for t in self.tools().values() if admitted[t.device]]

    def _build(self) -> dict[str, DeviceTool]:
        tools: dict[str, DeviceTool] = {}
        ambiguous: set[str] = set()
        for record in self.registry.list():
            if not record.connected or record.profile is None:
                continue
            for info in record.profile.tools:
                if info.meta:  # list_tools and the like: the listing already is that
                    continue
                name = mcp_name(record.name, info.name)
                if name in ambiguous:
                    continue
                if name in tools:
                    logger.warning("MCP gateway: tool %s of device %s maps to %s, as a tool of device %s does; "
                                   "neither is listed", info.name, record.name, name, tools[name].device)
                    ambiguous.add(name)
                    del tools[name]
                    continue
                tools[name] = DeviceTool(name, record.name, info)
        self._ambiguous = frozenset(ambiguous)
        return tools


DEVICE_FIELDS: dict[str, Any] = {
    "name": {"type": "string"},
    "status": {"type": "string", "enum": ["online", "busy", "offline"]},
    "platform": {"type": ["string", "null"]},
    "tags": {"type": "array", "items": {"type": "string"}},
    "tools": {"type": "integer", "description": "how many tools the device offers"},
    "sandbox": {"type": ["string", "null"], "description": "the OS sandbox around what it runs"},
    "running": {"type": "integer"},
    "queued": {"type": "integer"},
}

LIST_DEVICES_INPUT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "only devices whose name matches this name or glob"},
        "online_only": {"type": "boolean", "default": False, "description": "leave offline devices out"},
    },
    "additionalProperties": False,
}

LIST_DEVICES_OUTPUT: dict[str, Any] = {
    "type": "object",
    "properties": {"devices": {"type": "array", "items": {
        "type": "object", "properties": DEVICE_FIELDS, "required": list(DEVICE_FIELDS)}}},
    "required": ["devices"],
}


def device_row(record: DeviceRecord) -> dict[str, Any]:
    profile = record.profile
    return {"name": record.name, "status": record.status, "platform": record.platform,
            "tags": list(profile.tags) if profile else [],
            "tools": sum(1 for t in profile.tools if not t.meta) if profile else 0,
            "sandbox": profile.sandbox if profile else None,
            "running": max(record.running - record.queued, 0), "queued": record.queued}


def list_devices(registry: DeviceRegistry, arguments: dict[str, Any],
                 token: TokenInfo | None = None) -> dict[str, Any]:
    """The `list_devices` answer (only the devices `token` reaches); bad arguments raise ValueError."""
    name = arguments.get("name")
    online_only = arguments.get("online_only", False)
    unknown = set(arguments) - {"name", "online_only"}
    if unknown:
        raise ValueError(f"unknown argument(s): {', '.join(sorted(unknown))}")
    if name is not None and not isinstance(name, str):
        raise ValueError("name must be a string")
    if not isinstance(online_only, bool):
        raise ValueError("online_only must be true or false")
    rows = [device_row(r) for r in registry.list()
            if (name is None or fnmatch.fnmatchcase(r.name, name)) and not (online_only and not r.connected)
            and (token is None or token.reaches(r.name, r.tags))]
    return {"devices": rows}
