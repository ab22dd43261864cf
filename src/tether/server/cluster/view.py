"""Each node's device set in Redis with a digest beside it, so that every node's view of the others
converges without relying on pub/sub delivery.

The `fleet` broadcasts keep views current in the common case, but a broadcast is fire-and-forget: one
sent while a node was stopped (SIGSTOP, a long GC pause), while its subscription was reconnecting, or
while Redis itself restarted is never replayed. So each node also stores, leased like its node key:

- `tether:held:<node>`: a Redis set of the devices it holds;
- `tether:digest:<node>`: `digest()` of that set (its size and a hash of its sorted names).

On every heartbeat each node reads the digests of the live nodes in one MGET, compares each with the
digest of what its own registry shows at that node, and only for a node whose digests differ reads the
set (SMEMBERS) and asks the directory (the per-device keys, the authority) about the devices on which
the two disagree. A beat where nothing changed costs one round trip and a hash of the registry; a
difference costs a few more, in proportion to the node's devices, never a SCAN of the whole directory.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from tether.server.cluster.directory import PREFIX, REDIS_TIMEOUT_S, Directory

if TYPE_CHECKING:
    from redis.asyncio import Redis

CHUNK = 1000  # names per SADD or MGET: bounded commands, a few round trips for 10,000 devices


def digest(names: Iterable[str]) -> str:
    """The digest of a set of device names: `"<count>:<hash of the sorted names>"`; equal sets, and
    only those (up to a 96-bit hash collision), give equal digests."""
    ordered = sorted(names)
    hashed = hashlib.blake2b(digest_size=12)
    for name in ordered:
        hashed.update(name.encode())
        hashed.update(b"\n")
    return f"{len(ordered)}:{hashed.hexdigest()}"


def held_key(node: str) -> str:
    """The Redis key of the set of devices `node` holds."""
    return f"{PREFIX}:held:{node}"


def digest_key(node: str) -> str:
    """The Redis key of the digest of `node`'s set."""
    return f"{PREFIX}:digest:{node}"


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class HeldSets:
    """One node's end of the stored device sets: `store()` its own (each heartbeat and at every join),
    `differing()`, `members()` and `owners()` to check its view of the others. `lease_ms` is the node's
    lease: a node that stops renewing loses its set with its node key."""

    def __init__(self, redis: Redis, node: str, lease_ms: int) -> None:
        self.redis = redis
        self.node = node
        self.lease_ms = lease_ms
        self._stored: str | None = None  # the digest this node last wrote

    async def store(self, held: Collection[str]) -> bool:
        """Store `held` as this node's set (rewritten only when its digest changed or the stored one
        is gone; else both keys' leases are renewed). Returns True when the stored copy had vanished
        since this node last wrote it (its lease ran out while the node stalled, or Redis restarted
        empty): the other nodes may have shown its devices offline, so the caller announces them again.
        Raises what the Redis client raises, or TimeoutError after REDIS_TIMEOUT_S."""
        value = digest(held)
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            if value == self._stored:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.pexpire(held_key(self.node), self.lease_ms)
                    pipe.pexpire(digest_key(self.node), self.lease_ms)
                    _, kept = await pipe.execute()
                if kept:
                    return False
            names = sorted(held)
            async with self.redis.pipeline(transaction=True) as pipe:  # readers never see half a set
                pipe.exists(digest_key(self.node))
                pipe.delete(held_key(self.node))
                for at in range(0, len(names), CHUNK):
                    pipe.sadd(held_key(self.node), *names[at:at + CHUNK])
                pipe.pexpire(held_key(self.node), self.lease_ms)
                pipe.set(digest_key(self.node), value, px=self.lease_ms)
                existed = (await pipe.execute())[0]
        vanished = self._stored is not None and not existed
        self._stored = value
        return vanished

    def forget(self) -> None:
        """The next `store()` rewrites the set whatever it holds (after a rejoin: Redis may be empty)."""
        self._stored = None

    async def differing(self, shown: Mapping[str, str], nodes: Collection[str]) -> list[str]:
        """Those of `nodes` whose stored digest differs from `shown[node]` (the digest of the devices this
        node's view puts there; a node missing from `shown` shows none). A node with no stored digest
        (not written yet) is left out: its set is read once it has one."""
        wanted = sorted(set(nodes) - {self.node})
        if not wanted:
            return []
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            stored = await self.redis.mget([digest_key(n) for n in wanted])
        empty = digest(())
        return [node for node, value in zip(wanted, stored, strict=True)
                if value is not None and _text(value) != shown.get(node, empty)]

    async def members(self, node: str) -> set[str]:
        """The devices `node` stored as held (empty when its set is gone)."""
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            found = await self.redis.smembers(held_key(node))
        return {name for name in (_text(v) for v in found) if name is not None}

    async def owners(self, devices: Collection[str]) -> dict[str, str | None]:
        """Who holds each of `devices` as the directory says (None: nobody), in MGETs of CHUNK names."""
        names = sorted(devices)
        found: dict[str, str | None] = {}
        async with asyncio.timeout(REDIS_TIMEOUT_S * 2):
            for at in range(0, len(names), CHUNK):
                chunk = names[at:at + CHUNK]
                values = await self.redis.mget([Directory.device_key(d) for d in chunk])
                found.update((d, _text(v)) for d, v in zip(chunk, values, strict=True))
        return found
