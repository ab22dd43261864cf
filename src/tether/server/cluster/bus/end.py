"""`Bus`: one node's end of the bus, made of its asking and answering sides."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from tether.server.cluster.bus.answering import AnsweringBus
from tether.server.cluster.bus.asking import AskingBus
from tether.server.cluster.bus.inbox import Inbox
from tether.server.cluster.bus.messages import MAX_MESSAGE_BYTES, Handler
from tether.server.cluster.link import Links, Lookup

if TYPE_CHECKING:
    from redis.asyncio import Redis


class Bus(AskingBus, AnsweringBus):
    """One node's end of the bus. `handlers` maps a request kind to the coroutine that answers it;
    `lookup(node)` (a node's link URL) and `read_secret()` (the cluster secret), both given or neither,
    turn on direct links (`links`, whose `accept` the node's link endpoint calls), whose frames stay under
    `max_frame` characters (the nodes' WebSocket frame limit)."""

    def __init__(self, redis: Redis, reader: Redis, node: str, handlers: Mapping[str, Handler], *,
                 lookup: Lookup | None = None, read_secret: Callable[[], Awaitable[str]] | None = None,
                 max_frame: int = MAX_MESSAGE_BYTES) -> None:
        # `reader` is a connection of its own: a blocking XREAD would hold up every other command on it
        self.redis = redis
        self.reader = reader
        self.node = node
        self.handlers = dict(handlers)
        self.undelivered = {}
        self.unclaimed = None
        self._waiting = {}
        self._running = {}
        self._stopping = False
        self._inbox = Inbox(redis, reader, node, self._dispatch, lambda: self._stopping)
        self.links = Links(node, self._dispatch, self._link_lost, lookup, read_secret, max_frame=max_frame,
                           elsewhere=self._through_redis) if lookup is not None and read_secret is not None else None
