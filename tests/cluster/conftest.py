"""A private redis-server per test module (bench/kit/engines.py), and clients to it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from bench.kit.engines import Engine, redis_server


@pytest.fixture(scope="module")
def redis_engine() -> Iterator[Engine]:
    with redis_server() as engine:
        yield engine


@pytest.fixture
async def redis_client(redis_engine: Engine) -> AsyncIterator[object]:
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_engine.url, socket_timeout=10)
    await client.flushall()
    yield client
    await client.aclose()
