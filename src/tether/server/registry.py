"""`DeviceRegistry`: the server's AgentProfile — which devices exist, what they are, how busy they are.

The hub owns the registry and mutates its records; readers (REST API, CLI, the agent's device
selection) only read. Status is derived from the record rather than stored next to it, so it can
never disagree with the connection state and the load.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tether.protocol.profile import DeviceProfile, DeviceRequirements

DeviceStatus = Literal["online", "busy", "offline"]


class NoDeviceError(LookupError):
    """No device meets the requirements; the message says why each known device was passed over."""

    def __init__(self, message: str, reasons: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.reasons = reasons or {}


@dataclass
class DeviceRecord:
    """One device as the server sees it. Times are epoch seconds, for people and the store."""

    name: str
    profile: DeviceProfile | None = None
    connected: bool = False
    last_seen: float | None = None
    connected_at: float | None = None
    instance_id: str | None = None
    address: str | None = None
    inflight: int = 0  # batches this server has out on the device (sent or waiting to be sent)
    running: int = 0  # what the device reported in its last heartbeat: batches accepted, not finished
    queued: int = 0  # of those, the ones not started (behind their session, or waiting for a session slot)

    @property
    def load(self) -> int:
        """The larger of the two views of the same work, not their sum: the server's count includes
        batches queued for the device, the device's count includes work the server no longer tracks
        (e.g. a batch that timed out here but still runs there)."""
        return max(self.inflight, self.running)

    @property
    def status(self) -> DeviceStatus:
        if not self.connected:
            return "offline"
        return "busy" if self.load > 0 else "online"

    @property
    def platform(self) -> str | None:
        return self.profile.os.platform if self.profile else None

    def summary(self) -> dict[str, Any]:
        """A JSON-ready view for tables and APIs."""
        profile = self.profile
        return {"name": self.name, "status": self.status, "platform": self.platform, "load": self.load,
                "running": max(self.running - self.queued, 0), "queued": self.queued,
                "last_seen": self.last_seen, "connected_at": self.connected_at, "address": self.address,
                "gpu": bool(profile and profile.gpu.available), "tags": list(profile.tags) if profile else [],
                "capabilities": list(profile.capabilities) if profile else []}


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


class DeviceRegistry:
    """Records by device name, plus a change signal so waiters need no polling."""

    def __init__(self) -> None:
        self._records: dict[str, DeviceRecord] = {}
        self._changed: asyncio.Event | None = None  # made by the first waiter, dropped by the next notify

    def list(self) -> list[DeviceRecord]:
        return sorted(self._records.values(), key=lambda r: r.name)

    def get(self, name: str) -> DeviceRecord | None:
        return self._records.get(name)

    def ensure(self, name: str) -> DeviceRecord:
        record = self._records.get(name)
        if record is None:
            record = self._records[name] = DeviceRecord(name=name)
        return record

    def notify(self) -> None:
        """Wake everyone in `wait_until`; called by the hub after it changes a record (twice per
        command batch, so with nobody waiting it costs nothing)."""
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until `predicate()` holds (re-checked on every change), at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                async with asyncio.timeout(remaining):
                    if self._changed is None:
                        self._changed = asyncio.Event()
                    await self._changed.wait()
            except TimeoutError:
                return predicate()
        return True

    def select(self, req: DeviceRequirements | None = None) -> DeviceRecord:
        """The least-loaded connected device meeting `req` (ties by name), else `NoDeviceError`."""
        req = req or DeviceRequirements()
        if req.name is not None:
            candidates = [self._records[req.name]] if req.name in self._records else []
            if not candidates:
                raise NoDeviceError(f"no device fits {describe(req)}: no device named {req.name} has registered")
        else:
            candidates = self.list()
        if not candidates:
            raise NoDeviceError(f"no device fits {describe(req)}: no device has registered")
        reasons: dict[str, str] = {}
        fitting: list[DeviceRecord] = []
        for record in candidates:
            why = rejection(record, req)
            if why is None:
                fitting.append(record)
            else:
                reasons[record.name] = why
        if not fitting:
            raise NoDeviceError(f"no device fits {describe(req)}: {'; '.join(reasons.values())}", reasons)
        return min(fitting, key=lambda r: (r.load, r.name))
