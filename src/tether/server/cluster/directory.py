"""Leases in Redis: which nodes are alive, and which node holds each device's socket.

Every key carries an expiry, so a node that dies without a word loses its devices when their leases
run out (the heartbeat timeout plus grace), and nothing has to clean up after it. A device that
reconnects to another node is claimed there unconditionally (the newest socket wins); a node only
renews or releases a lease it still holds, checked and changed in one Lua script so a slow node can
never take back a device another node has claimed since.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redis.asyncio import Redis

PREFIX = "tether"
REDIS_TIMEOUT_S = 5.0

# renew each key still held by this node (ARGV[1] = node id, ARGV[2] = lease ms); return how many were
_RENEW = """
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('PEXPIRE', key, ARGV[2]); n = n + 1 end
end
return n
"""
# delete the key only if this node holds it
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Directory:
    """One node's view of the cluster's leases. `renew()` is called by the node's heartbeat loop."""

    def __init__(self, redis: Redis, node: str, *, lease_s: float = 30.0, info: dict[str, Any] | None = None) -> None:
        self.redis = redis
        self.node = node
        self.lease_ms = int(lease_s * 1000)
        self.info = {"node": node, "started": time.time(), **(info or {})}
        self._held: set[str] = set()
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    @staticmethod
    def device_key(device: str) -> str:
        return f"{PREFIX}:device:{device}"

    @staticmethod
    def node_key(node: str) -> str:
        return f"{PREFIX}:node:{node}"

    async def join(self) -> None:
        """Announce this node (again after a Redis restart: keys without persistence are gone)."""
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            await self.redis.set(self.node_key(self.node), json.dumps(self.info), px=self.lease_ms)

    async def leave(self) -> None:
        """A clean stop: this node's devices are free at once instead of when their leases expire."""
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            for device in list(self._held):
                await self._release(keys=[self.device_key(device)], args=[self.node])
            self._held.clear()
            await self._release(keys=[self.node_key(self.node)], args=[self.node])

    async def claim(self, device: str) -> None:
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            await self.redis.set(self.device_key(device), self.node, px=self.lease_ms)
        self._held.add(device)

    async def release(self, device: str) -> bool:
        """Drop this node's lease on `device`; False when another node holds it now."""
        self._held.discard(device)
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            return bool(await self._release(keys=[self.device_key(device)], args=[self.node]))

    async def renew(self) -> list[str]:
        """Renew the node's lease and its devices'; returns the devices lost to another node."""
        held = sorted(self._held)
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            if not await self._renew(keys=[self.node_key(self.node)], args=[self.node, self.lease_ms]):
                await self.join()  # expired (a long pause, or Redis restarted without persistence)
            lost: list[str] = []
            for chunk in _chunks(held, 500):
                owners = await self.redis.mget([self.device_key(d) for d in chunk])
                mine = [d for d, owner in zip(chunk, owners, strict=True) if _text(owner) == self.node]
                gone = [d for d, owner in zip(chunk, owners, strict=True) if owner is None]
                lost += [d for d, owner in zip(chunk, owners, strict=True)
                         if owner is not None and _text(owner) != self.node]
                if mine:
                    await self._renew(keys=[self.device_key(d) for d in mine], args=[self.node, self.lease_ms])
                for device in gone:  # expired while this node still holds the socket: take it back
                    await self.redis.set(self.device_key(device), self.node, px=self.lease_ms, nx=True)
        self._held.difference_update(lost)
        return lost

    async def holder(self, device: str) -> str | None:
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            return _text(await self.redis.get(self.device_key(device)))

    async def nodes(self) -> list[dict[str, Any]]:
        """The live nodes with what each announced, found by SCAN (never KEYS on a shared Redis)."""
        found: list[dict[str, Any]] = []
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            keys = [key async for key in self.redis.scan_iter(match=f"{PREFIX}:node:*", count=500)]
            for value in await self.redis.mget(keys) if keys else []:
                if value is not None:
                    found.append(json.loads(value))
        return sorted(found, key=lambda n: n["node"])


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _chunks(items: list[str], size: int) -> Iterable[list[str]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
