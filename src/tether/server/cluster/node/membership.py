"""A node's membership: the heartbeat (leases renewed, devices released, the view reconciled), joining and
rejoining after the backplane was away, the other nodes seen alive or gone, and the `fleet` broadcasts."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from tether.server.cluster.directory import REDIS_TIMEOUT_S
from tether.server.cluster.node.claims import Claims
from tether.server.cluster.node.core import FLEET_CHANNEL, MAX_BEAT_S, REJOIN_S, RELAY_CHANNEL, log, safe
from tether.server.cluster.node.relay import Relays


class Membership(Claims, Relays):
    """`ClusterNode`'s heartbeat, joins and broadcasts."""

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
        log.warning("cluster backplane %s is back: node %s joined again", safe(self.url), self.node)
        with contextlib.suppress(Exception):  # the subscription re-subscribes on a fresh connection
            await self.subscriber.connection_pool.disconnect()
        self._wake.set()

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
