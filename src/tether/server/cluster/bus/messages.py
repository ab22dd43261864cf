"""The bus's messages: its limits, the kinds of failure, and a request waiting on its answer."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tether.errors import ServerError

if TYPE_CHECKING:
    from tether.server.cluster.link import Link

log = logging.getLogger("tether.cluster")

PREFIX = "tether"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
INBOX_MAXLEN = 100_000
READ_BLOCK_MS = 2_000
REDIS_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 2.0  # how long a stopping node waits for its reader before cancelling it
RESENDABLE = frozenset({"batch", "cancel"})  # request kinds sent again through Redis when their link drops

Send = Callable[[dict[str, Any]], Awaitable[None]]
Handler = Callable[[dict[str, Any], Send], Awaitable[dict[str, Any]]]


class BusError(ServerError):
    """The other node answered with an error, or did not answer in time."""


class BusInterrupted(BusError):
    """This node gave up waiting on a request (`Bus.interrupt`): the answer is wanted elsewhere now."""


@dataclass(eq=False)
class Waiting:
    """A request waiting on its answer. Its messages (`part`, `done`, `interrupt`) go into `queue` (for
    `Bus.request`'s generator), or, with `answer` set (`Bus.ask`), each part to `on_part`, a final body to
    `on_done` too, and the first `done` or `interrupt` into `answer`, straight from the reader: no queue and
    no wake-up per message."""

    queue: asyncio.Queue[dict[str, Any]] | None = None
    node: str = ""
    link: Link | None = None  # the link the request went over (None: through Redis)
    message: dict[str, Any] = field(default_factory=dict)  # the request itself, to send again
    on_part: Callable[[dict[str, Any]], None] | None = None
    on_done: Callable[[dict[str, Any]], None] | None = None
    answer: asyncio.Future[dict[str, Any]] | None = None

    def deliver(self, message: dict[str, Any]) -> None:
        if self.queue is not None:
            self.queue.put_nowait(message)
            return
        if message.get("t") == "part":
            if self.on_part is not None and self.answer is not None and not self.answer.done():
                self.on_part(message["body"])
        elif self.answer is not None and not self.answer.done():
            self.answer.set_result(message)
            if self.on_done is not None and message.get("t") == "done" and "error" not in message \
                    and isinstance(message.get("body"), dict):
                try:
                    self.on_done(message["body"])
                except Exception:  # the reader goes on; the asker's task handles the answer itself
                    log.exception("handling the answer from node %s at once failed", self.node)


def encode(message: dict[str, Any]) -> str:
    """`message` as compact JSON; BusError when it is over `MAX_MESSAGE_BYTES`."""
    text = json.dumps(message, separators=(",", ":"))
    if len(text) > MAX_MESSAGE_BYTES:
        raise BusError(f"a cluster message of {len(text)} bytes is over the {MAX_MESSAGE_BYTES}-byte cap")
    return text


def text(value: bytes | str) -> str:
    """A Redis reply's bytes as text (a str as it is)."""
    return value.decode() if isinstance(value, bytes) else value
