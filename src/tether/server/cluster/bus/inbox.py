"""A node's inbox on Redis: the Redis Stream its messages arrive on when no direct link carries them, and
the way into another node's."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from tether.server.cluster.bus.messages import (
    INBOX_MAXLEN,
    PREFIX,
    READ_BLOCK_MS,
    REDIS_TIMEOUT_S,
    STOP_TIMEOUT_S,
    BusError,
    encode,
    log,
    text,
)

if TYPE_CHECKING:
    from redis.asyncio import Redis


class Inbox:
    """Node `node`'s inbox: `start()` reads it from now on, handing each message to `dispatch` (until
    `stopping()` says the node stops and `stop()` ends the read); `send(node, message)` writes to any node's.
    `reader` is a connection of its own: a blocking XREAD would hold up every other command on `redis`."""

    def __init__(self, redis: Redis, reader: Redis, node: str, dispatch: Callable[[dict[str, Any]], None],
                 stopping: Callable[[], bool]) -> None:
        self.redis = redis
        self.reader = reader
        self.node = node
        self.dispatch = dispatch
        self.stopping = stopping
        self._reader_task: asyncio.Task[None] | None = None
        self._last_id = "$"

    @staticmethod
    def name(node: str) -> str:
        """The Redis key of `node`'s inbox."""
        return f"{PREFIX}:inbox:{node}"

    async def start(self) -> None:
        """Read the inbox from now on. With Redis away this still starts: the read loop keeps trying,
        and reads what arrives once it is back (requests sent meanwhile could not be sent)."""
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                info = await self.redis.xinfo_stream(self.name(self.node)) if await self.redis.exists(
                    self.name(self.node)) else None
            self._last_id = text(info["last-generated-id"]) if info else "0-0"
        except Exception as exc:
            log.warning("cluster bus: cannot read %s yet (%s)", self.name(self.node), exc)
            self._last_id = "$"
        self._reader_task = asyncio.create_task(self._read_loop(), name=f"bus-reader-{self.node}")

    async def stop(self) -> None:
        """End the read (once `stopping()` is true)."""
        # A blocked XREAD is not cancelled: redis-py can swallow a cancellation that lands in a read
        # and retry the command (seen here: the task stayed "cancelling" inside a new XREAD). The
        # reader's connections are closed instead, which ends the read with an error the loop sees.
        with contextlib.suppress(Exception):
            await self.reader.connection_pool.disconnect()
        if self._reader_task is not None:
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):  # a read ends at once; a backoff sleep is cut
                    await self._reader_task
            except (TimeoutError, asyncio.CancelledError, Exception):
                self._reader_task.cancel()

    async def send(self, node: str, message: dict[str, Any]) -> None:
        """Write `message` to `node`'s inbox; BusError (never a driver's exception) when Redis does not take it."""
        data = encode(message)
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await self.redis.xadd(self.name(node), {"m": data}, maxlen=INBOX_MAXLEN, approximate=True)
        except TimeoutError:
            raise BusError(f"cluster backplane unavailable: Redis did not take a message for node {node} "
                           f"within {REDIS_TIMEOUT_S:g} s") from None
        except Exception as exc:
            raise BusError(f"cluster backplane unavailable: Redis refused a message for node {node}: {exc}") from exc

    async def _read_loop(self) -> None:
        backoff = 0.1
        while not self.stopping():
            try:
                # RESP2, the client's protocol here, answers [[stream, [(id, fields), …]], …] (or None when
                # the block ran out); redis-py types every protocol's answer in one union
                batches = cast(list[list[Any]] | None, await self.reader.xread(
                    {self.name(self.node): self._last_id}, block=READ_BLOCK_MS, count=500))
                if backoff > 0.1:
                    log.warning("cluster bus: reading %s again", self.name(self.node))
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarting or unreachable: keep trying; said once, not per try
                if self.stopping():
                    return
                (log.warning if backoff == 0.1 else log.debug)(
                    "cluster bus: reading %s failed (%s); retrying with backoff", self.name(self.node), exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            for _, entries in batches or ():
                for entry_id, fields in entries:
                    self._last_id = text(entry_id)
                    try:
                        message = json.loads(fields[b"m"] if b"m" in fields else fields["m"])
                    except (KeyError, ValueError) as exc:
                        log.warning("cluster bus: unreadable message %s dropped (%s)", self._last_id, exc)
                        continue
                    self.dispatch(message)
            if batches:  # let the woken askers and new handlers run before this task sends the next XREAD
                await asyncio.sleep(0)
