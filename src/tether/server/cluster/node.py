"""`ClusterNode`: one `tether server --cluster redis://…` process as a node of the cluster.

It keeps three things true while the server runs:
- the directory says which devices this node holds: a device is claimed when it registers here
  (in one pipeline with the broadcast that tells the other nodes) and released when it is gone
  for good (its grace period over), and every claim is renewed by one heartbeat loop;
- this node's registry lists the devices the other nodes hold (`DeviceRecord.node`), from the
  `fleet` broadcasts and, after every (re)join, from the directory itself, and every heartbeat from
  the stored device sets (fleet.py, view.py): a broadcast missed while the node stalled or Redis
  was away is never relied on;
- the hub hands it batches for devices held elsewhere (`RemoteDevices`, server/ports.py), which
  the `Router` runs on the holding node.

When Redis cannot be reached the node says so (`problem()`, `/api/v1/health`) and refuses work for
other nodes' devices with a clear 503 instead of guessing where they are; its own devices keep
working. When Redis is back it joins again, claims its devices again and re-reads the directory;
the nodes it knew are given one lease to join again before their devices are shown offline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from tether.errors import ServerError
from tether.server.cluster.bus import Bus
from tether.server.cluster.directory import PREFIX, REDIS_TIMEOUT_S, Directory
from tether.server.cluster.fleet import FleetView
from tether.server.cluster.link import api_url, default_url, new_secret
from tether.server.cluster.routing import Router
from tether.server.cluster.view import HeldSets, digest_key, held_key
from tether.server.ports import BackplaneUnavailable, RemoteSlot

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from tether.protocol.messages import ClientMessage, ServerMessage
    from tether.server.aip.batches.ledger import PendingBatch, TokenRef
    from tether.server.aip.fleet.registry import DeviceRegistry
    from tether.server.aip.hub import DeviceHub
    from tether.server.settings import ServerSettings
    from tether.server.store import Store

log = logging.getLogger("tether.cluster")

FLEET_CHANNEL = f"{PREFIX}:events:fleet"
RELAY_CHANNEL = f"{PREFIX}:events:relay"
SECRET_KEY = f"{PREFIX}:link-secret"  # the cluster secret the direct links prove (link.py)
RELAY_QUEUE = 10_000  # events waiting for Redis; past it they are dropped (and followers re-read the store)
MAX_BEAT_S = 5.0  # the heartbeat's longest period: how soon a lost or returned backplane is noticed
REJOIN_S = 0.5  # while the backplane is away, how often the node tries it again
STOP_TIMEOUT_S = 2.0  # a stopping node's goodbye to Redis, and its loops' ends


class ClusterUnavailable(ServerError, RuntimeError):
    """The cluster option cannot work here (the redis package is missing)."""


def _redis_client(url: str, read_timeout: float) -> Redis:
    try:
        import redis.asyncio as aioredis
    except ImportError:
        raise ClusterUnavailable("--cluster needs the redis package: pip install 'tether[cluster]'") from None
    return aioredis.from_url(url, socket_timeout=read_timeout, socket_connect_timeout=REDIS_TIMEOUT_S,
                             health_check_interval=0)


def _safe(url: str) -> str:
    from tether.server.store.engine import safe_url

    return safe_url(url)


class ClusterNode:
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
        self.redis = _redis_client(self.url, REDIS_TIMEOUT_S)
        # the bus's blocking XREAD and the broadcast subscription each hold a connection of their own
        self.reader = _redis_client(self.url, REDIS_TIMEOUT_S + 3)
        self.subscriber = _redis_client(self.url, REDIS_TIMEOUT_S)
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

    # -- life --------------------------------------------------------------------------------------

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
        log.info("cluster node %s on %s%s", self.node, _safe(self.url),
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

    # -- direct links (link.py) --------------------------------------------------------------------

    async def _link_url(self, node: str) -> str | None:
        """The link URL `node` announced with its node entry (None: it has none, or is not alive)."""
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            raw = await self.redis.get(Directory.node_key(node))
        try:
            url = json.loads(raw).get("link") if raw else None
        except (ValueError, AttributeError):
            return None
        return url if isinstance(url, str) else None

    async def _link_secret(self) -> str:
        """The cluster secret in Redis, made by the first node that asks."""
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            await self.redis.set(SECRET_KEY, new_secret(), nx=True)
            secret = await self.redis.get(SECRET_KEY)
        if secret is None:
            raise ServerError("the cluster secret vanished from Redis as it was made")
        return secret.decode() if isinstance(secret, bytes) else str(secret)

    # -- what the hub and the API ask (RemoteDevices) ----------------------------------------------

    def problem(self) -> str | None:
        return None if self._problem is None else f"cluster backplane unavailable: {self._problem}"

    async def holder(self, device: str, *, fresh: bool = False) -> str | None:
        """The live node holding `device` now: as the broadcasts told this node, or (`fresh`, or when they
        did not) as the directory says."""
        if self._problem is not None:
            raise BackplaneUnavailable(self.problem())
        record = None if fresh else self.registry.get(device)
        if record is not None and record.connected and record.node in self._alive:
            # what the broadcasts said: no Redis round trip per command. A stale answer costs one retry:
            # that node answers "not held here" and the Router asks the directory (Router._wait_holder)
            return record.node
        try:
            node = await self.directory.holder(device)
            if node is not None and node != self.node and node not in self._alive:
                async with asyncio.timeout(REDIS_TIMEOUT_S):  # a node that joined since the last beat?
                    if not await self.redis.exists(Directory.node_key(node)):
                        return None  # a dead node's lease not expired yet: nobody holds it
                self._alive.add(node)
        except Exception as exc:
            self._fail(exc)
            raise BackplaneUnavailable(self.problem()) from None
        return node

    def hint(self, device: str) -> str | None:
        record = self.registry.get(device)
        if record is None or record.node is None or record.node == self.node or record.node not in self._alive:
            return None
        return self._api.get(record.node)

    async def run_batch(self, batch: PendingBatch, holder: str) -> None:
        await self.router.run_batch(batch, holder)

    async def request(self, holder: str, device: str, message: ServerMessage, timeout: float) -> ClientMessage:
        return await self.router.request(holder, device, message, timeout)

    async def cancel(self, response_id: str, reason: str) -> bool:
        if self._problem is not None:
            return False
        return await self.router.cancel(sorted(self._alive), response_id, reason)

    async def answer_question(self, device: str, question: str, action: str, content: dict[str, Any] | None,
                              by: str, answerer: TokenRef | None = None) -> bool:
        holder = await self.holder(device)
        if holder is None or holder == self.node:
            return False
        return await self.router.answer(holder, {"device": device, "question": question, "action": action,
                                                 "content": content, "by": by,
                                                 "answerer": answerer.to_dict() if answerer is not None else None})

    async def call(self, node: str, kind: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self._problem is not None:
            raise BackplaneUnavailable(self.problem())
        return await self.bus.call(node, kind, body, timeout)

    def handle(self, kind: str, handler: Any) -> None:
        async def answer(body: dict[str, Any], send: Any) -> dict[str, Any]:
            return await handler(body)

        self.bus.handlers[kind] = answer

    def health(self) -> dict[str, Any]:
        """The cluster part of /api/v1/health."""
        return {"node": self.node, "backplane": "ok" if self._problem is None else self.problem(),
                "nodes": sorted(self._alive | {self.node})}

    # -- events for followers on other nodes -------------------------------------------------------

    def relay(self, topic: str, data: dict[str, Any]) -> None:
        try:
            self._relayed.put_nowait(json.dumps({"relay": topic, "from": self.node, "data": data}, default=str))
        except asyncio.QueueFull:
            log.warning("cluster relay: %d events waiting for Redis; a %s event was dropped", RELAY_QUEUE, topic)

    def on_relay(self, topic: str, listener: Any) -> Any:
        key = object()
        self._relay_listeners.setdefault(topic, {})[key] = listener
        return lambda: self._relay_listeners.get(topic, {}).pop(key, None)

    async def _relay_pump(self) -> None:
        """One publisher for every relayed event: they reach the other nodes in the order they happened."""
        while True:
            text = await self._relayed.get()
            try:
                async with asyncio.timeout(REDIS_TIMEOUT_S):
                    await self.redis.publish(RELAY_CHANNEL, text)
            except Exception as exc:
                self._fail(exc)

    def _on_relay(self, event: dict[str, Any]) -> None:
        if event.get("from") == self.node or not isinstance(event.get("data"), dict):
            return
        for listener in list(self._relay_listeners.get(str(event.get("relay")), {}).values()):
            try:
                listener(event["data"])
            except Exception:
                log.exception("cluster relay listener for %s failed", event.get("relay"))

    # -- claims: this node's devices in the directory ---------------------------------------------

    async def claimed(self, device: str) -> None:
        """Return once `device` (registering here) is in the directory, so that when it is told it is
        registered every node can reach it; at once while the backplane is away, and never longer than
        REDIS_TIMEOUT_S (the claim is retried by the heartbeat)."""
        if self._problem is not None:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._claim_waiters.setdefault(device, []).append(done)
        self._fleet_change(device)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await done

    def _fleet_change(self, device: str) -> None:
        """The hub's listener (synchronous): a device registered, left or changed its profile here."""
        self._dirty.add(device)
        self._wake.set()

    async def _claims(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._problem is not None:
                continue  # claimed again, all at once, when the backplane is back (_rejoin)
            devices, self._dirty = self._dirty, set()
            try:
                await self._claim([d for d in devices if self.hub.local(d)])
                for device in devices:
                    if not self.hub.holds(device) and device in self.directory._held:
                        await self._release(device)
            except Exception as exc:
                self._dirty |= devices
                self._fail(exc)
            finally:
                for device in devices:
                    for done in self._claim_waiters.pop(device, ()):
                        if not done.done():
                            done.set_result(None)

    async def _claim(self, devices: list[str]) -> None:
        """Claim `devices` for this node and tell the other nodes, in one pipeline (a registration storm
        of 1,000 devices is a few round trips, not 2,000)."""
        if not devices:
            return
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            async with self.redis.pipeline(transaction=False) as pipe:
                for device in devices:
                    record = self.registry.get(device)
                    pipe.set(Directory.device_key(device), self.node, px=self.directory.lease_ms)
                    # the device process's instance: the node it reconnects to next resumes its batches
                    pipe.publish(FLEET_CHANNEL, json.dumps({"device": device, "node": self.node,
                                                            "instance": record and record.instance_id}))
                await pipe.execute()
        self.directory._held.update(devices)
        for device in devices:
            self.router.device_seen(device, self.node)

    async def _release(self, device: str) -> None:
        if await self.directory.release(device):
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await self.redis.publish(FLEET_CHANNEL, json.dumps({"device": device, "node": None}))

    # -- the heartbeat -----------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        period = min(self.settings.lease_s / 3, MAX_BEAT_S)
        while True:
            # a timer, not a wait for an event: the lease is renewed on time
            await asyncio.sleep(period if self._problem is None else min(period, REJOIN_S))
            try:
                if self._problem is not None:
                    await self._rejoin()
                    continue
                lost = await self.directory.renew()
                for device in lost:
                    log.info("device %s is held by another node now", device)
                for device in [d for d in list(self.directory._held) if not self.hub.holds(d)]:
                    await self._release(device)  # its grace period ended here
                if await self.held.store(self.directory._held):  # Redis lost it: restarted empty, or a stall
                    self._expect_rejoins()
                    await self._announce()
                await self._see_nodes()
                await self.view.reconcile()
            except Exception as exc:
                self._fail(exc)

    async def _announce(self) -> None:
        """This node's leases ran out while it was stopped (the other nodes showed its devices offline
        and dropped it): say it joined and claim its devices again, broadcast, so the others list them
        at once rather than at their next beat's check."""
        log.warning("cluster node %s stalled past its lease: announcing its %d device(s) again", self.node,
                    len(self.directory._held))
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            await self.redis.publish(FLEET_CHANNEL, json.dumps({"joined": self.node}))
        await self._claim(self.hub.local_devices())

    async def _see_nodes(self) -> None:
        nodes = await self.directory.nodes()
        alive = {n["node"] for n in nodes}
        self._api = {n["node"]: n["api"] for n in nodes if isinstance(n.get("api"), str)}
        now = asyncio.get_running_loop().time()
        self._awaited = {n: until for n, until in self._awaited.items() if n not in alive and until > now}
        alive |= set(self._awaited)
        for gone in self._alive - alive - {self.node}:
            log.warning("cluster node %s is gone (its lease ran out)", gone)
            if self.bus.links is not None:
                self.bus.links.drop(gone)
            self.router.node_gone(gone)
            for record in self.registry.list():
                if record.node == gone:
                    self.view.seen(record.name, None)
        self._alive = alive - {self.node}

    def _expect_rejoins(self) -> None:
        """Redis may have lost every key (it restarted empty): the nodes this one knows are given one lease
        to claim their devices again before they are called gone and their devices shown offline, so a
        command crossing to a device that never moved is not told it left."""
        until = asyncio.get_running_loop().time() + self.settings.lease_s
        self._awaited = {**{node: until for node in self._alive}, **self._awaited}

    async def _join(self) -> None:
        await self.directory.join()
        async with asyncio.timeout(REDIS_TIMEOUT_S):  # the others list this node now, not at their next beat
            await self.redis.publish(FLEET_CHANNEL, json.dumps({"joined": self.node}))
        await self._claim(self.hub.local_devices())
        self.held.forget()
        await self.held.store(self.directory._held)
        self._expect_rejoins()
        await self.view.resync()
        await self._see_nodes()
        self._problem = None

    async def _rejoin(self) -> None:
        # the pool's idle connections may be to a Redis that restarted since: each would fail once ("closed
        # by server") and mark the backplane down again right after it came back
        with contextlib.suppress(Exception):
            await self.redis.connection_pool.disconnect(inuse_connections=False)
        await self._join()
        log.warning("cluster backplane %s is back: node %s joined again", _safe(self.url), self.node)
        with contextlib.suppress(Exception):  # the subscription re-subscribes on a fresh connection
            await self.subscriber.connection_pool.disconnect()
        self._wake.set()

    def _fail(self, exc: BaseException) -> None:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self._problem is None or self._problem == "joining the cluster":
            log.warning("cluster backplane %s unavailable (%s): work for other nodes' devices is refused until "
                        "it is back", _safe(self.url), why)
        self._problem = why

    async def _listen(self) -> None:
        """The `fleet` broadcasts, for as long as the node runs; re-subscribed (and the directory re-read)
        after any connection loss."""
        backoff = 0.1
        while True:
            pubsub = self.subscriber.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(FLEET_CHANNEL, RELAY_CHANNEL)
                if self._problem is None:
                    await self.view.resync()
                backoff = 0.1
                while True:
                    message = await pubsub.get_message(timeout=None)
                    if message is not None:
                        await self._on_broadcast(message.get("data"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("cluster subscription lost (%s); again in %.1f s", exc, backoff)
                self._expect_rejoins()  # the re-read that follows may find Redis restarted empty
                await asyncio.sleep(backoff)  # backoff between reconnection attempts
                backoff = min(backoff * 2, MAX_BEAT_S)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _node_news(self, joined: str, left: str) -> None:
        if joined and joined != self.node:
            self._alive.add(joined)
        if left and left != self.node:
            self._alive.discard(left)
            if self.bus.links is not None:
                self.bus.links.drop(left)
            self.router.node_gone(left)

    async def _on_broadcast(self, data: Any) -> None:
        try:
            event = json.loads(data)
            if "relay" in event:
                self._on_relay(event)
                return
            if "joined" in event or "left" in event:
                self._node_news(str(event.get("joined") or ""), str(event.get("left") or ""))
                return
            device, node = str(event["device"]), event.get("node")
            instance = event.get("instance")
        except (TypeError, ValueError, KeyError):
            return
        if node is None:  # released: but a claim elsewhere may have overtaken the release on the way
            try:
                node = await self.directory.holder(device)
            except Exception as exc:
                self._fail(exc)
                return
        self.view.seen(device, None if node is None else str(node), instance if isinstance(instance, str) else None)
        if node is not None and node != self.node:
            self._alive.add(str(node))
