"""`DeviceView`: what the planner knows of one device (its tools, and its profile when known), made from
whatever a caller holds (`as_device_view`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tether.protocol.models import ToolInfo
from tether.protocol.profile import DeviceProfile


@dataclass
class DeviceView:
    """What the planner knows of one device: its profile (optional) and its tools."""

    tools: list[ToolInfo] = field(default_factory=list)
    profile: DeviceProfile | None = None


DeviceLike = DeviceView | DeviceProfile | Sequence[ToolInfo] | Mapping[str, Any]


def as_device_view(value: DeviceLike) -> DeviceView:
    """`value` as a `DeviceView`: a view as it is, a profile with its tools, a mapping with `tools` and/or
    `profile` (validated; `ValidationError` when malformed), or a plain list of tools."""
    if isinstance(value, DeviceView):
        return value
    if isinstance(value, DeviceProfile):
        return DeviceView(tools=list(value.tools), profile=value)
    if isinstance(value, Mapping):
        profile = value.get("profile")
        if isinstance(profile, Mapping):
            profile = DeviceProfile.model_validate(profile)
        tools = value.get("tools")
        if tools is None and profile is not None:
            tools = profile.tools
        return DeviceView(tools=[t if isinstance(t, ToolInfo) else ToolInfo.model_validate(t) for t in tools or []],
                          profile=profile)
    return DeviceView(tools=list(value))
