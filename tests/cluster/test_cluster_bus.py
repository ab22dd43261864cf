"""The cluster's leases and node-to-node messages against a real redis-server (groundwork for issue 16)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from bench.kit.engines import Engine
from tether.server.cluster.bus import Bus, BusError
from tether.server.cluster.directory import Directory


async def _client(engine: Engine) -> Any:
    import redis.asyncio as aioredis

    return aioredis.from_url(engine.url, socket_timeout=10)


async def test_a_device_is_held_by_the_node_that_claimed_it_last(redis_client: Any) -> None:
    a = Directory(redis_client, "a", lease_s=30, info={"url": "http://a"})
    b = Directory(redis_client, "b", lease_s=30)
    await a.join()
    await b.join()
    assert [n["node"] for n in await a.nodes()] == ["a", "b"]
    await a.claim("laptop")
    assert await b.holder("laptop") == "a"
    await b.claim("laptop")  # the device reconnected to b: the newest socket wins
    assert await a.holder("laptop") == "b"
    assert await a.renew() == ["laptop"]  # a learns it lost the device, and does not take it back
    assert await a.holder("laptop") == "b"
    assert await a.release("laptop") is False  # a cannot free what b holds
    assert await b.release("laptop") is True
    assert await a.holder("laptop") is None


async def test_a_dead_node_loses_its_devices_when_their_leases_expire(redis_client: Any) -> None:
    await redis_client.config_set("notify-keyspace-events", "Ex")
    events = redis_client.pubsub()
    await events.subscribe("__keyevent@0__:expired")
    short = Directory(redis_client, "dying", lease_s=0.2)
    await short.join()
    await short.claim("phone")
    expired: set[str] = set()
    async with asyncio.timeout(10):  # no renew: wait for Redis to say both keys expired
        while len(expired) < 2:
            message = await events.get_message(ignore_subscribe_messages=True, timeout=5)
            if message:
                expired.add(message["data"].decode())
    await events.aclose()
    assert expired == {Directory.device_key("phone"), Directory.node_key("dying")}
    assert await short.holder("phone") is None
    assert "dying" not in [n["node"] for n in await Directory(redis_client, "x").nodes()]


async def test_renew_takes_back_an_expired_lease_it_still_holds(redis_client: Any) -> None:
    d = Directory(redis_client, "a", lease_s=30)
    await d.claim("tablet")
    await redis_client.delete(Directory.device_key("tablet"))  # as if it expired during a long pause
    assert await d.renew() == []
    assert await d.holder("tablet") == "a"
    assert await redis_client.pttl(Directory.device_key("tablet")) > 0


@contextlib.asynccontextmanager
async def _bus(engine: Engine, node: str, handlers: dict[str, Any]) -> Any:
    redis, reader = await _client(engine), await _client(engine)
    bus = Bus(redis, reader, node, handlers)
    await bus.start()
    try:
        yield bus
    finally:
        await bus.aclose()
        await redis.aclose()
        await reader.aclose()


async def test_a_request_streams_parts_and_its_result_across_nodes(redis_engine: Engine) -> None:
    async def run(body: dict[str, Any], send: Any) -> dict[str, Any]:
        for i in range(3):
            await send({"chunk": f"{body['cmd']}-{i}"})
        return {"status": "ok"}

    async def broken(body: dict[str, Any], send: Any) -> dict[str, Any]:
        raise ValueError("device laptop refused: rm is denied")

    async with _bus(redis_engine, "holder", {"run": run, "broken": broken}), _bus(redis_engine, "asker", {}) as asker:
        got = [part async for part in asker.request("holder", "run", {"cmd": "ls"}, timeout=10)]
        assert got == [{"chunk": "ls-0"}, {"chunk": "ls-1"}, {"chunk": "ls-2"}, {"status": "ok"}]
        with pytest.raises(BusError, match="rm is denied"):
            await asker.call("holder", "broken", {}, timeout=10)
        with pytest.raises(BusError, match="no handler for 'nope'"):
            await asker.call("holder", "nope", {}, timeout=10)


async def test_a_request_to_a_node_that_is_gone_times_out_clearly(redis_engine: Engine) -> None:
    async with _bus(redis_engine, "asker", {}) as asker:
        with pytest.raises(BusError, match=r"did not answer run within 0\.2 s"):
            await asker.call("nobody", "run", {}, timeout=0.2)


async def test_giving_up_cancels_the_work_on_the_other_node(redis_engine: Engine) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def long(body: dict[str, Any], send: Any) -> dict[str, Any]:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return {}

    async with _bus(redis_engine, "holder", {"long": long}), _bus(redis_engine, "asker", {}) as asker:
        call = asyncio.create_task(asker.call("holder", "long", {}, timeout=60))
        await asyncio.wait_for(started.wait(), 10)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await asyncio.wait_for(cancelled.wait(), 10)


async def test_the_bus_survives_a_redis_restart(redis_engine: Engine) -> None:
    async def echo(body: dict[str, Any], send: Any) -> dict[str, Any]:
        return body

    async with _bus(redis_engine, "holder", {"echo": echo}), _bus(redis_engine, "asker", {}) as asker:
        assert await asker.call("holder", "echo", {"n": 1}, timeout=10) == {"n": 1}
        await asyncio.to_thread(redis_engine.restart)
        # the readers reconnect on their own; a request sent meanwhile may be lost with the old
        # Redis, so ask until one is answered, each bounded
        for attempt in range(50):
            try:
                assert await asker.call("holder", "echo", {"n": 2}, timeout=1) == {"n": 2}
                break
            except BusError:
                if attempt == 49:
                    raise
