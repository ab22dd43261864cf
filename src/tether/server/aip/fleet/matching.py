"""Whether a device fits a command's requirements, and why not: `rejection`, `describe`, `NoDeviceError`."""

from __future__ import annotations

import json

from tether.errors import ServerError
from tether.protocol.profile import DeviceProfile, DeviceRequirements
from tether.server.aip.fleet.record import DeviceRecord


class NoDeviceError(ServerError, LookupError):
    """No device meets the requirements; the message says why each known device was passed over."""

    def __init__(self, message: str, reasons: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.reasons = reasons or {}


def describe(req: DeviceRequirements) -> str:
    """`{gpu: true, platform: "linux"}`: only what was actually asked for."""
    asked = req.model_dump(exclude_defaults=True)
    return "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in asked.items()) + "}"


def _tool_names(profile: DeviceProfile) -> set[str]:
    names: set[str] = set()
    for tool in profile.tools:
        names.add(tool.name)
        names.add(f"{tool.namespace}/{tool.name}")
    return names


def rejection(record: DeviceRecord, req: DeviceRequirements) -> str | None:
    """Why `record` does not fit `req`, or None when it fits."""
    if not record.connected:
        return f"{record.name} is offline"
    profile = record.profile or DeviceProfile()
    if req.platform and (profile.os.platform or "").lower() != req.platform.lower():
        return f"{record.name} runs {profile.os.platform or 'an unknown platform'}, not {req.platform}"
    if req.gpu is True and not profile.gpu.available:
        return f"{record.name} has no GPU"
    if req.gpu is False and profile.gpu.available:
        return f"{record.name} has a GPU and gpu: false was asked"
    missing_tags = [t for t in req.tags if t not in profile.tags]
    if missing_tags:
        return f"{record.name} lacks tag(s) {', '.join(missing_tags)}"
    if req.tools:
        offered = _tool_names(profile)
        missing = [t for t in req.tools if t not in offered]
        if missing:
            return f"{record.name} lacks tool(s) {', '.join(missing)}"
    return None
