"""`ClusterNode`: one `tether server --cluster redis://…` process as a node, made of its parts (see the
package's docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from typing import TYPE_CHECKING, Any

from tether.server.cluster.bus import Bus
from tether.server.cluster.directory import REDIS_TIMEOUT_S, Directory
from tether.server.cluster.fleet import FleetView
from tether.server.cluster.link import api_url, default_url
from tether.server.cluster.node.core import FLEET_CHANNEL, RELAY_QUEUE, STOP_TIMEOUT_S, log, redis_client, safe
from tether.server.cluster.node.membership import Membership
from tether.server.cluster.node.remote import RemoteSide
from tether.server.cluster.routing import Router
from tether.server.cluster.view import HeldSets, digest_key, held_key

if TYPE_CHECKING:
    from tether.server.aip.fleet.registry import DeviceRegistry
    from tether.server.aip.hub import DeviceHub
    from tether.server.ports import RemoteSlot
    from tether.server.settings import ServerSettings
    from tether.server.store import Store


class ClusterNode(Membership, RemoteSide):
    """This server as a node; `start()` in the app's lifespan after the hub, `aclose()` before it.

    Built with the node's hub, the hub's device registry, the store (outcomes whose asker is gone are
    recorded there) and the `RemoteSlot` the hub was built with, where the node attaches itself while it
    runs; `settings.cluster_url` must be set."""

    def __init__(self, hub: DeviceHub, registry: DeviceRegistry, store: Store, settings: ServerSettings,
                 slot: RemoteSlot) -> None:
        assert settings.cluster_url is not None
        self.hub = hub
        self.slot = slot  # the hub's view of the cluster: this node while it runs
        self.registry = registry
        self.settings = settings
        self.node = settings.node
        self.url = settings.cluster_url
        self.redis = redis_client(self.url, REDIS_TIMEOUT_S)
        # the bus's blocking XREAD and the broadcast subscription each hold a connection of their own
        self.reader = redis_client(self.url, REDIS_TIMEOUT_S + 3)
        self.subscriber = redis_client(self.url, REDIS_TIMEOUT_S)
        linked = settings.cluster_link != "off"
        link = settings.cluster_link if linked and settings.cluster_link else \
            default_url(settings.host, settings.port, settings.tls, self.url)
        # the API URL goes to callers (the X-Tether-Holder hint); the link URL, when on, to the other nodes
        info: dict[str, Any] = {"pid": os.getpid(), "port": settings.port, "api": api_url(link),
                                **({"link": link} if linked else {})}
        self.directory = Directory(self.redis, self.node, lease_s=settings.lease_s, info=info)
        self.held = HeldSets(self.redis, self.node, self.directory.lease_ms)
        self.bus = Bus(self.redis, self.reader, self.node, {}, lookup=self._link_url if linked else None,
                       read_secret=self._link_secret if linked else None,
                       max_frame=settings.max_frame_bytes * 2)  # the WebSocket frame limit the nodes' servers take
        self.router = Router(hub, registry, store, settings, self.bus, self.node, self.holder)
        self.bus.undelivered["batch"] = self.router.record_lost_answer
        self.bus.unclaimed = self.router.record_unclaimed
        self.router.alive = lambda node: node in self._alive
        self.view = FleetView(self.node, hub, registry, self.router, self.redis, self.held,
                              lambda: self._alive, lambda: self._awaited)
        self.bus.handlers.update(batch=self.router.serve_batch, cancel=self.router.serve_cancel,
                                 answer=self.router.serve_answer, request=self.router.serve_request)
        self._problem: str | None = "joining the cluster"
        self._alive: set[str] = set()
        self._api: dict[str, str] = {}  # node -> its API base URL, as it announced (refreshed every beat)
        # after a rejoin: the nodes alive before it, not seen since, and until when they are given to join
        # again (Redis may have restarted empty; their absence says nothing until they have had a beat)
        self._awaited: dict[str, float] = {}
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._remove_listener: Any = None
        self._claim_waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._relayed: asyncio.Queue[str] = asyncio.Queue(maxsize=RELAY_QUEUE)
        self._relay_listeners: dict[str, dict[object, Any]] = {}

    async def start(self) -> None:
        """Join (or, with Redis away, start degraded and keep trying: a node must come up while Redis
        restarts), start the bus, the heartbeat, the claims and the subscription."""
        try:
            await self._join()
        except Exception as exc:
            self._fail(exc)
        await self.bus.start()
        self.slot.attach(self)
        self._remove_listener = self.hub.on_fleet_change(self._fleet_change)
        self._tasks = [asyncio.create_task(self._heartbeat(), name="cluster-heartbeat"),
                       asyncio.create_task(self._claims(), name="cluster-claims"),
                       asyncio.create_task(self._listen(), name="cluster-listen"),
                       asyncio.create_task(self._relay_pump(), name="cluster-relay")]
        log.info("cluster node %s on %s%s", self.node, safe(self.url),
                 f" (degraded: {self._problem})" if self._problem else "")

    async def aclose(self) -> None:
        """A clean stop: this node's devices are free at once instead of when their leases run out. Bounded
        (STOP_TIMEOUT_S for the goodbye, the same for the loops): with Redis away a node still stops."""
        self.slot.detach()
        if self._remove_listener is not None:
            self._remove_listener()
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await self.subscriber.connection_pool.disconnect()
        if self._problem is None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await self.directory.leave()
                    await self.redis.delete(held_key(self.node), digest_key(self.node))
                    await self.redis.publish(FLEET_CHANNEL, json.dumps({"left": self.node}))
        await self.bus.aclose()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=STOP_TIMEOUT_S)
        for client in (self.redis, self.reader, self.subscriber):
            with contextlib.suppress(Exception):
                await client.aclose()
