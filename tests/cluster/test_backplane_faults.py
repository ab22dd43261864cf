"""The backplane (Bus, Directory) under network faults between a node and Redis (issue 16).

Each node talks to a real redis-server through its own `RedisLink` (clusterkit.py), which the test
cuts (connections reset, new ones refused), black-holes (nothing forwarded, nothing reset: the node
learns only by its own timeouts) and restores. What must hold:
- a node cut off from Redis fails its requests at once with a BusError that says so, and works
  again once the link is back, with nothing to restart;
- a request whose asker gave up while the answering node was black-holed is never run when the
  partition heals (the asker's cancel follows it in the same inbox);
- a node partitioned for longer than its leases loses them (they expire; no one cleans up); back,
  it takes again the devices nobody else took and learns which ones another node took meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bench.kit.engines import Engine
from tests.kits.cluster import RedisLink
from tether.server.cluster.bus import Bus, BusError
from tether.server.cluster.directory import Directory

WAIT = 30.0


@contextlib.asynccontextmanager
async def linked(engine: Engine) -> AsyncIterator[tuple[RedisLink, Any, Any]]:
    """A link to Redis and two clients through it (one for commands, one for the bus's blocking reads)."""
    import redis.asyncio as aioredis

    link = await RedisLink(engine.port).start()
    clients = [aioredis.from_url(link.url(), socket_timeout=3, socket_connect_timeout=3) for _ in range(2)]
    try:
        yield link, clients[0], clients[1]
    finally:
        for client in clients:
            await client.aclose()
        await link.aclose()


@contextlib.asynccontextmanager
async def node_bus(engine: Engine, node: str, handlers: dict[str, Any]) -> AsyncIterator[tuple[Bus, RedisLink]]:
    async with linked(engine) as (link, redis, reader):
        bus = Bus(redis, reader, node, handlers)
        await bus.start()
        try:
            yield bus, link
        finally:
            await bus.aclose()


async def echo(body: dict[str, Any], send: Any) -> dict[str, Any]:
    return body


async def answered(asker: Bus, node: str, body: dict[str, Any]) -> dict[str, Any]:
    """Ask until answered (the reader of a node whose link came back reconnects on its own, with
    backoff); each try bounded, the whole bounded by WAIT."""
    async with asyncio.timeout(WAIT):
        while True:
            try:
                return await asker.call(node, "echo", body, timeout=1)
            except BusError:
                continue


async def test_a_node_cut_off_from_redis_fails_clearly_and_works_again(redis_engine: Engine) -> None:
    async with node_bus(redis_engine, "holder", {"echo": echo}), \
            node_bus(redis_engine, "asker", {}) as (asker, asker_link):
        assert await asker.call("holder", "echo", {"n": 1}, timeout=10) == {"n": 1}
        asker_link.cut()
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(BusError, match="Redis refused a message for node holder"):
            await asker.call("holder", "echo", {"n": 2}, timeout=10)
        assert loop.time() - started < 10, "a cut link fails at once, not at the request's timeout"
        asker_link.restore()
        assert await answered(asker, "holder", {"n": 3}) == {"n": 3}


async def test_a_request_given_up_during_a_black_hole_is_not_run_when_it_heals(redis_engine: Engine) -> None:
    ran: list[int] = []

    async def work(body: dict[str, Any], send: Any) -> dict[str, Any]:
        ran.append(body["n"])
        return body

    handlers = {"work": work, "echo": echo}
    async with node_bus(redis_engine, "holder", handlers) as (_, holder_link), \
            node_bus(redis_engine, "asker", {}) as (asker, _):
        assert await asker.call("holder", "work", {"n": 1}, timeout=10) == {"n": 1}
        holder_link.cut(blackhole=True)
        with pytest.raises(BusError, match=r"node holder did not answer work within 0\.5 s"):
            await asker.call("holder", "work", {"n": 2}, timeout=0.5)
        holder_link.restore()
        assert await answered(asker, "holder", {"n": 3}) == {"n": 3}
        assert await asker.call("holder", "work", {"n": 4}, timeout=10) == {"n": 4}
        assert ran == [1, 4], "the request the asker gave up on ran after the partition healed"


async def test_leases_lost_in_a_long_partition_are_taken_back_unless_another_node_took_them(
        redis_engine: Engine) -> None:
    import redis.asyncio as aioredis

    direct = aioredis.from_url(redis_engine.url, socket_timeout=10)
    await direct.config_set("notify-keyspace-events", "Ex")
    expired = direct.pubsub()
    await expired.subscribe("__keyevent@0__:expired")
    try:
        async with linked(redis_engine) as (link, redis, _):
            mine = Directory(redis, "a", lease_s=0.3)
            other = Directory(direct, "b", lease_s=30)
            await mine.join()
            for device in ("laptop", "phone"):
                await mine.claim(device)
            link.cut(blackhole=True)  # no renewal gets through: a's leases run out
            gone: set[str] = set()
            async with asyncio.timeout(WAIT):
                while len(gone) < 3:
                    message = await expired.get_message(ignore_subscribe_messages=True, timeout=5)
                    if message:
                        gone.add(message["data"].decode())
            assert gone == {Directory.node_key("a"), Directory.device_key("laptop"), Directory.device_key("phone")}
            await other.claim("phone")  # the phone reconnected to b meanwhile
            link.restore()
            async with asyncio.timeout(WAIT):  # the first try may meet a connection the black hole left dead
                while True:
                    try:
                        lost = await mine.renew()
                        break
                    except Exception:
                        continue
            assert lost == ["phone"]
            assert await other.holder("laptop") == "a" and await other.holder("phone") == "b"
            assert "a" in [n["node"] for n in await other.nodes()]
    finally:
        await expired.aclose()
        await direct.aclose()
