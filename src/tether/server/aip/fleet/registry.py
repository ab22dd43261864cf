"""`DeviceRegistry`: the server's AgentProfile — which devices exist, what they are, how busy they are.

The hub owns the registry and mutates its records; readers (REST API, CLI, the agent's device
selection) only read. Status is derived from the record rather than stored next to it, so it can
never disagree with the connection state and the load.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase

from pydantic import BaseModel, ValidationError

from tether.protocol.profile import DeviceProfile, DeviceRequirements
from tether.server.aip.fleet.device_index import NameIndex, literal_prefix
from tether.server.aip.fleet.matching import NoDeviceError, describe, rejection
from tether.server.aip.fleet.record import DeviceRecord, DeviceStatus
from tether.server.aip.fleet.schemas import ToolPool

_SHARED_PARTS = ("cpu", "memory", "disk", "gpu", "os")  # profile sections equal across a fleet's builds
# lists of names equal across a fleet's builds (and its groups, for tags)
_SHARED_LISTS = ("installed_apps", "mcp_servers", "tags", "capabilities", "write_roots", "read_roots")


class SharedNames(list[str]):
    """A profile's list of names, one object for every profile listing the same names. Weakly held by the
    registry (a plain list cannot be); nothing in the server changes a profile's lists in place (a device's
    new profile replaces its old one whole)."""

    __slots__ = ("__weakref__",)


class SharedFieldsSet(set[str]):
    """A profile's `model_fields_set`, one set for all profiles whose set fields are the same, weakly held.
    Adding a field to it is a no-op when it is already set, and the server never assigns a field a profile
    was registered without."""

    __slots__ = ()  # a set can be weakly referenced already


logger = logging.getLogger("tether.server.aip.registry")  # the name operators filter on


# what the store hands back for a device's full profile: (profile JSON without tools, tools digest, tools JSON)
StoredProfile = tuple[str, str | None, str | bytes | None]


class DeviceRegistry:
    """Records by device name, plus a change signal so waiters need no polling.

    Besides the records it keeps sorted name lists per status, platform and tag, so a page of the
    device list with a filter walks the smallest matching list from the cursor on — O(page), not
    O(fleet) — and the lists stay in step with every profile and connection change (the records'
    `profile` and `connected` setters report here).
    """

    def __init__(self, tools: ToolPool | None = None) -> None:
        self._records: dict[str, DeviceRecord] = {}
        self._changed: asyncio.Event | None = None  # made by the first waiter, dropped by the next notify
        self.tools = tools or ToolPool()
        # reads a device's stored profile when a record known only from the store is first asked for it
        self.profile_loader: Callable[[str], StoredProfile | None] | None = None
        self._index = NameIndex()
        self._parts: weakref.WeakValueDictionary[str, BaseModel] = weakref.WeakValueDictionary()
        self._lists: weakref.WeakValueDictionary[tuple[str, ...], SharedNames] = weakref.WeakValueDictionary()
        self._fields_sets: weakref.WeakValueDictionary[frozenset[str], SharedFieldsSet] = \
            weakref.WeakValueDictionary()
        self._tag_overrides: dict[str, tuple[str, ...]] = {}  # tags an admin set: they stand for the device's

    def __len__(self) -> int:
        return len(self._records)

    def list(self) -> list[DeviceRecord]:
        records = self._records
        return [records[name] for name in self._index.names]

    def get(self, name: str) -> DeviceRecord | None:
        return self._records.get(name)

    def ensure(self, name: str) -> DeviceRecord:
        record = self._records.get(name)
        if record is None:
            record = self._records[name] = DeviceRecord(name=name)
            record._registry = self
            self._index.add(name)
        return record

    def known(self, name: str, last_seen: float | None, platform: str | None,
              tags: builtins.list[str] | tuple[str, ...], stored: bool) -> DeviceRecord:
        """A device remembered by the store: listed (offline) at once, its profile read when first used."""
        record = self.ensure(name)
        record.last_seen = record.last_seen or last_seen
        if record._profile is None and not record._lazy and stored:
            self._reindex(record, platform, tuple(tags))
            record._lazy = True
        return record

    async def preload(self, chunk: int = 64, start_after: float = 0.0) -> int:
        """Read every stored profile not read yet, `chunk` per loop turn: the first dashboard or
        unpaged list over 10,000 known devices must not stall the loop for seconds reading them all at
        once. `start_after` seconds leave the server's own start (and /health) the loop first. Returns
        how many were read."""
        if start_after > 0:
            await asyncio.sleep(start_after)
        read = 0
        names = list(self._index.names)
        for at in range(0, len(names), chunk):
            for name in names[at:at + chunk]:
                record = self._records.get(name)
                if record is not None and record._lazy:
                    self._load(record)
                    read += 1
            await asyncio.sleep(0)
        return read

    def held_elsewhere(self, name: str, node: str | None) -> DeviceRecord:
        """In a cluster: `name`'s socket is held by the node `node` (None: by no node). Its profile is
        read again from the shared store when next used, since it registered there with what it has now."""
        record = self.ensure(name)
        record.node = node
        record.running = record.queued = 0
        if node is not None:
            record.last_seen = time.time()
            if self.profile_loader is not None:
                record._lazy = True
        record.connected = node is not None
        self.notify()
        return record

    def override_tags(self, name: str, tags: Sequence[str]) -> None:
        """Device `name`'s tags are `tags` from now on, in place of those its profile reports (now and at each
        registration): the record's profile and the tag index change at once."""
        self._tag_overrides[name] = tuple(tags)
        record = self._records.get(name)
        if record is None:
            return
        if record._profile is not None:
            record._profile.__dict__["tags"] = list(tags)  # the profile is this record's own (its parts shared)
            self._share_parts(record._profile)
        self._reindex(record, record._platform, tuple(tags))

    def tag_override(self, name: str) -> tuple[str, ...] | None:
        """The tags an admin set on device `name` (`override_tags`), or None."""
        return self._tag_overrides.get(name)

    def forget(self, name: str) -> None:
        """Drop a device's record (and its hold on an interned tool list, and any tags set on it)."""
        self._tag_overrides.pop(name, None)
        record = self._records.pop(name, None)
        if record is None:
            return
        record._lazy = False
        self._set_profile(record, None)
        self._index.drop(name)
        record._registry = None

    # -- indexes ---------------------------------------------------------------------------------

    def _reindex(self, record: DeviceRecord, platform: str | None, tags: tuple[str, ...]) -> None:
        if record._platform != platform:
            self._index.platform(record.name, record._platform, platform)
            record._platform = platform
        if record._tags != tags:
            self._index.tags(record.name, record._tags, tags)
            record._tags = tags

    def _set_connected(self, record: DeviceRecord, connected: bool) -> None:
        if record._registry is not self:
            return
        self._index.connected(record.name, connected)

    def _set_profile(self, record: DeviceRecord, profile: DeviceProfile | None, digest: str | None = None) -> None:
        """Give `record` its profile, the tool list swapped for the pool's shared copy of it."""
        old = record._digest
        if profile is None:
            record._digest = None
        elif digest is not None:  # its tools are the pool's list for `digest` already
            record._digest = digest
        else:
            record._digest, tools = self.tools.intern(profile.tools)
            profile.__dict__["tools"] = tools  # not setattr: its fields set may be a shared one (_share_parts)
        if profile is not None:
            override = self._tag_overrides.get(record.name)
            if override is not None:
                profile.__dict__["tags"] = list(override)
            self._share_parts(profile)
        if old is not None:
            self.tools.release(old)
        record._profile, record._lazy = profile, False
        self._reindex(record, profile.os.platform if profile else None, tuple(profile.tags) if profile else ())

    def _share_parts(self, profile: DeviceProfile) -> None:
        """Swap the profile's hardware and OS sections, and its lists of names, for equal ones another device
        already holds: each section is a model of its own, and a fleet is mostly a few builds. Held weakly: a
        section goes with the last profile using it."""
        values = profile.__dict__  # swapped in place: setattr would mark the field as set by the device
        for part in _SHARED_PARTS:
            value = getattr(profile, part)
            key = f"{part}:{value.model_dump_json()}"
            shared = self._parts.get(key)
            if shared is None:
                self._parts[key] = value
            elif shared is not value:
                values[part] = shared
        for field in _SHARED_LISTS:
            names = getattr(profile, field)
            if isinstance(names, SharedNames):
                continue
            list_key = (field, *names)
            shared_names = self._lists.get(list_key)
            if shared_names is None:
                shared_names = self._lists[list_key] = SharedNames(names)
            values[field] = shared_names
        fields = profile.__pydantic_fields_set__
        if not isinstance(fields, SharedFieldsSet):
            shared_fields = self._fields_sets.get(frozenset(fields))
            if shared_fields is None:
                shared_fields = self._fields_sets[frozenset(fields)] = SharedFieldsSet(fields)
            object.__setattr__(profile, "__pydantic_fields_set__", shared_fields)

    def _load(self, record: DeviceRecord) -> None:
        """Read a record's stored profile (once: a failure leaves it without one, logged)."""
        record._lazy = False
        try:
            stored = self.profile_loader(record.name) if self.profile_loader is not None else None
        except Exception:
            logger.exception("could not read the stored profile of device %s", record.name)
            return
        if stored is None:
            return
        profile_json, digest, tools_json = stored
        try:
            profile = DeviceProfile.model_validate_json(profile_json)
            if digest is not None and self.tools.get(digest) is not None:
                profile.tools = self.tools.acquire(digest)
            elif digest is not None and tools_json is not None:
                profile.tools = self.tools.acquire(digest, self.tools.codec.validate_json(tools_json))
            else:
                digest = None
        except ValidationError:
            logger.warning("stored profile of device %s is unreadable; ignored", record.name)
            return
        self._set_profile(record, profile, digest)

    # -- the device list -------------------------------------------------------------------------

    def page(self, *, status: DeviceStatus | None = None, platform: str | None = None, tags: Sequence[str] = (),
             name: str | None = None, after: str | None = None, limit: int | None = None
             ) -> tuple[builtins.list[DeviceRecord], str | None]:
        """Records matching every filter, by name, after the name `after`, at most `limit` of them, and
        the cursor of the next page (None on the last). `name` is a glob (`lab-*`); platform is compared
        without case. Devices that join or leave between pages neither repeat nor hide the others."""
        names = self._index.candidates(status, platform, tags)
        prefix = literal_prefix(name) if name is not None else ""
        first = NameIndex.start(names, after, prefix)
        wanted = set(tags)
        platform_key = platform.lower() if platform is not None else None
        found: list[DeviceRecord] = []
        records = self._records
        for at in range(first, len(names)):
            key = names[at]
            if prefix and not key.startswith(prefix):
                break
            record = records[key]
            if status is not None and record.status != status:
                continue
            if platform_key is not None and (record._platform or "").lower() != platform_key:
                continue
            if wanted and not wanted.issubset(record._tags):
                continue
            if name is not None and not fnmatchcase(key, name):
                continue
            if limit is not None and len(found) == limit:
                return found, found[-1].name
            found.append(record)
        return found, None

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

    def select(self, req: DeviceRequirements | None = None,
               within: Callable[[DeviceRecord], bool] | None = None) -> DeviceRecord:
        """The least-loaded connected device meeting `req` (ties by name), else `NoDeviceError`; with
        `within` (a token's device scope), only among the devices it admits (the others are not seen)."""
        req = req or DeviceRequirements()
        if req.name is not None:
            candidates = [self._records[req.name]] if req.name in self._records else []
            if within is not None:
                candidates = [r for r in candidates if within(r)]
            if not candidates:
                raise NoDeviceError(f"no device fits {describe(req)}: no device named {req.name} has registered")
        else:
            candidates = self.list() if within is None else [r for r in self.list() if within(r)]
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
