"""`DeviceRecord`: one device as the server sees it, and the statuses derived from it."""

from __future__ import annotations

from typing import Any, Literal, Protocol

from tether.protocol.profile import DeviceProfile


class RecordOwner(Protocol):
    """What a record reports its changes to and reads its stored profile through (the `DeviceRegistry`)."""

    def _load(self, record: DeviceRecord) -> None: ...

    def _set_profile(self, record: DeviceRecord, profile: DeviceProfile | None, digest: str | None = None) -> None: ...

    def _set_connected(self, record: DeviceRecord, connected: bool) -> None: ...


DeviceStatus = Literal["online", "busy", "offline"]
STATUSES: tuple[DeviceStatus, ...] = ("online", "busy", "offline")


class DeviceRecord:
    """One device as the server sees it. Times are epoch seconds, for people and the store.

    Slotted, and its profile's tool list shared through the registry's `ToolPool`: a fleet holds
    thousands of these. A device known only from the store (not connected since the server started)
    carries its name, platform and tags for listing, and reads its full profile on first use.
    """

    __slots__ = ("_connected", "_digest", "_lazy", "_platform", "_profile", "_registry", "_tags", "address",
                 "connected_at", "inflight", "instance_id", "last_seen", "name", "node", "queued", "running")

    def __init__(self, name: str, profile: DeviceProfile | None = None, connected: bool = False,
                 last_seen: float | None = None, connected_at: float | None = None,
                 instance_id: str | None = None, address: str | None = None) -> None:
        self.name = name
        self._registry: RecordOwner | None = None
        self._profile: DeviceProfile | None = None
        self._connected = False
        self._digest: str | None = None  # the ToolPool digest of the profile's tools
        self._platform: str | None = None
        self._tags: tuple[str, ...] = ()
        self._lazy = False  # a stored profile not read yet
        self.last_seen, self.connected_at = last_seen, connected_at
        self.instance_id, self.address = instance_id, address
        self.inflight = 0  # batches this server has out on the device (sent or waiting to be sent)
        self.running = 0  # what the device reported in its last heartbeat: batches accepted, not finished
        self.queued = 0  # of those, the ones not started (behind their session, or waiting for a session slot)
        self.node: str | None = None  # in a cluster: the other node holding the device's socket
        if profile is not None:
            self.profile = profile
        self.connected = connected

    def __repr__(self) -> str:
        return f"DeviceRecord({self.name!r}, status={self.status!r}, platform={self._platform!r})"

    @property
    def profile(self) -> DeviceProfile | None:
        """The device's profile (read from the store on first use for a device known only from it); None
        before it registered. Setting it re-indexes the record in its registry."""
        if self._lazy and self._registry is not None:
            self._registry._load(self)
        return self._profile

    @profile.setter
    def profile(self, profile: DeviceProfile | None) -> None:
        if self._registry is not None:
            self._registry._set_profile(self, profile)
        else:
            self._profile, self._lazy = profile, False
            self._platform = profile.os.platform if profile else None
            self._tags = tuple(profile.tags) if profile else ()

    @property
    def connected(self) -> bool:
        """Whether the device's socket is held (here or, in a cluster, by another node); setting it
        re-indexes the record in its registry."""
        return self._connected

    @connected.setter
    def connected(self, connected: bool) -> None:
        if self._registry is not None and connected != self._connected:
            self._registry._set_connected(self, connected)
        self._connected = connected

    @property
    def tools_digest(self) -> str | None:
        """The content digest of the profile's tool list (None without a profile)."""
        if self._lazy:
            _ = self.profile
        return self._digest

    @property
    def tags(self) -> tuple[str, ...]:
        """The device's tags: an admin's override where one is set, else its profile's."""
        return self._tags

    @property
    def load(self) -> int:
        """The larger of the two views of the same work, not their sum: the server's count includes
        batches queued for the device, the device's count includes work the server no longer tracks
        (e.g. a batch that timed out here but still runs there)."""
        return max(self.inflight, self.running)

    @property
    def status(self) -> DeviceStatus:
        """`offline` when not connected, else `busy` while `load` > 0, else `online`."""
        if not self._connected:
            return "offline"
        return "busy" if self.load > 0 else "online"

    @property
    def platform(self) -> str | None:
        """The platform its profile reports (`linux`, `darwin`, ...), or None."""
        return self._platform

    def summary(self) -> dict[str, Any]:
        """A JSON-ready view for tables and APIs."""
        profile = self.profile
        return {"name": self.name, "status": self.status, "platform": self.platform, "load": self.load,
                "running": max(self.running - self.queued, 0), "queued": self.queued,
                "last_seen": self.last_seen, "connected_at": self.connected_at, "address": self.address,
                "node": self.node,
                "gpu": bool(profile and profile.gpu.available), "tags": list(self._tags),
                "capabilities": list(profile.capabilities) if profile else []}
