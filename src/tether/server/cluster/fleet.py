"""One node's picture of the devices the other nodes hold (its registry's `DeviceRecord.node`), kept
true from three sources: the `fleet` broadcasts (`seen`), the whole directory after a (re)join or a new
subscription (`resync`), and, every heartbeat, the stored device sets (`reconcile`, view.py), which
converge without pub/sub delivery."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from tether.server.cluster.directory import REDIS_TIMEOUT_S, Directory
from tether.server.cluster.view import HeldSets, digest

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from tether.server.aip.fleet.registry import DeviceRegistry
    from tether.server.aip.hub import DeviceHub
    from tether.server.cluster.routing import Router

SCAN_CHUNK = 1000


class FleetView:
    """Built by `ClusterNode` with its node id, hub, registry, router, Redis client and stored sets;
    `alive()` gives the other live nodes and `awaited()` those given time to join again after a rejoin
    (their devices are not shown offline meanwhile)."""

    def __init__(self, node: str, hub: DeviceHub, registry: DeviceRegistry, router: Router, redis: Redis,
                 held: HeldSets, alive: Callable[[], set[str]], awaited: Callable[[], Collection[str]]) -> None:
        self.node = node
        self.hub = hub
        self.registry = registry
        self.router = router
        self.redis = redis
        self.held = held
        self.alive = alive
        self.awaited = awaited

    async def reconcile(self) -> None:
        """Make this node's view of the live nodes' devices agree with what they stored (view.py): one
        MGET of their digests; for a node whose digest differs from what the registry shows there, its
        set is read and the directory asked about each device on which the two disagree."""
        shown: dict[str, set[str]] = {}
        for record in self.registry.list():
            if record.node is not None and record.connected and not self.hub.local(record.name):
                shown.setdefault(record.node, set()).add(record.name)
        stale = await self.held.differing({n: digest(names) for n, names in shown.items()}, self.alive())
        for node in stale:
            disputed = await self.held.members(node) ^ shown.get(node, set())
            for device, owner in (await self.held.owners(disputed)).items():
                if owner is not None and owner != self.node and owner not in self.alive():
                    owner = None  # a dead node's lease not expired yet: nobody holds it
                self.seen(device, owner)

    async def resync(self) -> None:
        """Read the whole directory (SCAN, never KEYS): what this node missed while it was away."""
        held: dict[str, str] = {}
        prefix = len(Directory.device_key(""))
        async with asyncio.timeout(REDIS_TIMEOUT_S * 6):
            keys = [key async for key in self.redis.scan_iter(match=Directory.device_key("*"), count=SCAN_CHUNK)]
            for at in range(0, len(keys), SCAN_CHUNK):
                chunk = keys[at:at + SCAN_CHUNK]
                for key, value in zip(chunk, await self.redis.mget(chunk), strict=True):
                    if value is not None:
                        name = (key.decode() if isinstance(key, bytes) else key)[prefix:]
                        held[name] = value.decode() if isinstance(value, bytes) else value
        for name, node in held.items():
            if node != self.node:
                self.seen(name, node)
        for record in self.registry.list():
            if record.node is not None and record.name not in held and record.node not in self.awaited():
                self.seen(record.name, None)

    def seen(self, device: str, node: str | None, instance: str | None = None) -> None:
        """`device` is held by `node` (None: by no node), as another node or the directory says; with the
        device process's `instance`, a reconnection of that process here resumes (its batches go on)."""
        if node == self.node or self.hub.local(device):
            return  # this node's own socket is the truth about it
        record = self.registry.get(device)
        if instance is not None and record is not None:
            record.instance_id = instance
        if record is not None and record.node == node and (node is None) != record.connected:
            return
        if node is not None:
            self.hub.moved(device, node)  # what this node still waited for in the device's grace goes there
        record = self.registry.held_elsewhere(device, node)
        if instance is not None:
            record.instance_id = instance
        self.router.device_seen(device, node)
        self.hub.fleet_changed(device)
