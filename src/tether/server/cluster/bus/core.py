"""What every part of a node's bus shares: its state, its start and stop, and the way a message goes
to another node — over the open link to it, else through its inbox, and again through Redis when a link
drops under it."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from tether.server.cluster.bus.inbox import Inbox
from tether.server.cluster.bus.messages import (
    PREFIX,
    REDIS_TIMEOUT_S,
    RESENDABLE,
    BusError,
    Handler,
    Waiting,
    encode,
    log,
)
from tether.server.cluster.link import Link, Links

if TYPE_CHECKING:
    from redis.asyncio import Redis


class BusCore:
    """The state of a node's bus (`Bus` builds it) and its sending; the asking (asking.py) and answering
    (answering.py) sides build on it."""

    redis: Redis
    reader: Redis
    node: str
    handlers: dict[str, Handler]
    # kind -> called with (request body, reply body) when a reply could not be sent (the backplane is
    # down): what the asker never hears must still be recorded (a batch's outcome, in the audit)
    undelivered: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]]
    # called with the body of an answer that came after its request gave up (read once the backplane
    # is back): what this node's caller was told was pending is recorded from it
    unclaimed: Callable[[dict[str, Any]], None] | None
    links: Links | None
    _waiting: dict[str, Waiting]
    _running: dict[str, asyncio.Task[None]]
    _stopping: bool
    _inbox: Inbox

    @property
    def stopping(self) -> bool:
        """This node is stopping (its handlers are being cancelled for that, not by their askers)."""
        return self._stopping

    @staticmethod
    def inbox(node: str) -> str:
        """The Redis key of `node`'s inbox."""
        return Inbox.name(node)

    async def start(self) -> None:
        """Read the inbox from now on. With Redis away this still starts: the read loop keeps trying,
        and reads what arrives once it is back (requests sent meanwhile could not be sent)."""
        await self._inbox.start()

    async def aclose(self) -> None:
        """Stop: the handlers running here are cancelled, the links closed, the inbox's read ended, and every
        request still waiting is answered "this node is stopping"."""
        self._stopping = True
        for task in list(self._running.values()):
            task.cancel()
        if self.links is not None:
            await self.links.aclose()
        await self._inbox.stop()
        for waiting in self._waiting.values():
            waiting.deliver({"t": "done", "error": "this node is stopping"})

    async def publish(self, channel: str, event: dict[str, Any]) -> None:
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            await self.redis.publish(f"{PREFIX}:events:{channel}", encode(event))

    async def _send(self, node: str, message: dict[str, Any], waiting: Waiting | None = None) -> None:
        """Over the open link to `node`, else through its inbox. A request's `waiting` notes the link first, so
        that a link lost as it is written has it sent again (`_link_lost`). Raises BusError, never a
        driver's exception: callers need one kind of failure to handle."""
        link = self.links.get(node) if self.links is not None else None
        if link is not None:
            if waiting is not None:
                waiting.link = link
            await link.send(message)  # a failed write closes the link: what it carried is sent again or rerouted
            return
        await self._send_redis(node, message)

    def _link_lost(self, node: str, link: Link) -> None:
        """The link to `node` dropped: the requests waiting on an answer over it are sent again through
        Redis (`RESENDABLE` kinds) or answered with an error that says they may have run."""
        for rid, waiting in list(self._waiting.items()):
            if waiting.link is not link:
                continue
            waiting.link = None
            log.info("cluster link to node %s dropped while request %s (%s) waited: %s", node, rid,
                     waiting.message.get("kind"), "sent again through Redis" if waiting.message.get("kind") in
                     RESENDABLE else "answered 'may have run'")
            if waiting.message.get("kind") in RESENDABLE:
                key = f"resend-{rid}"
                task = self._running[key] = asyncio.create_task(self._resend(node, waiting), name=f"bus-{key}")
                task.add_done_callback(partial(self._forget, key))
            else:
                waiting.deliver({"t": "done", "error": f"the link to node {node} dropped before it "
                                                       "answered; the request may have run there"})

    def _through_redis(self, node: str, message: dict[str, Any]) -> None:
        """A message a link could not carry (too large for a frame, or queued on a link that closed): through
        Redis (an error answer to its asker when even that refuses it)."""
        key = f"redis-{secrets.token_hex(4)}"
        task = self._running[key] = asyncio.create_task(self._send_through_redis(node, message), name=f"bus-{key}")
        task.add_done_callback(partial(self._forget, key))

    async def _send_through_redis(self, node: str, message: dict[str, Any]) -> None:
        try:
            await self._send_redis(node, message)
        except BusError as exc:
            log.warning("a %s message for node %s could not go over its link, and Redis refused it: %s",
                        message.get("t"), node, exc)
            if message.get("t") == "done":  # its asker would otherwise wait to its timeout
                with contextlib.suppress(BusError):
                    await self._send_redis(node, {"t": "done", "rid": message.get("rid"), "error": str(exc)})

    def _forget(self, key: str, _task: asyncio.Task[None]) -> None:
        self._running.pop(key, None)

    async def _resend(self, node: str, waiting: Waiting) -> None:
        try:
            await self._send_redis(node, waiting.message)
        except BusError as exc:
            waiting.deliver({"t": "done", "error": f"the link to node {node} dropped before it answered, "
                                                   f"and the request could not be sent again: {exc}"})

    async def _send_redis(self, node: str, message: dict[str, Any]) -> None:
        await self._inbox.send(node, message)
