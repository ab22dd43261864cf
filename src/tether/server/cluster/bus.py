"""Messages between the nodes of a cluster over Redis: requests with streamed partial replies, and
broadcasts.

Each node reads one inbox, a Redis Stream (`tether:inbox:<node>`). A request carries an id and the
asking node; the node that handles it sends zero or more `part` messages (a command's output as it
streams) and one `done` (the result or an error) to the asker's inbox. Streams rather than pub/sub
for requests: their round trips are alike, and a stream keeps a message while a node reconnects to Redis
where pub/sub drops it. Broadcasts (device and task events every node's followers see) are
pub/sub: a follower that was away re-reads its state anyway.

A node reads its inbox from the moment it starts: requests sent to an earlier incarnation of the
node are not answered, and their askers time out as they would with a device gone.

With `lookup` and `read_secret` given, messages to a node go over a direct link to it (link.py) while
one is open, and through its inbox otherwise; what arrives either way is handled alike. A request
waiting on an answer over a link that drops is sent again through Redis with the same id (the
answering node ignores a repeat of a request it is still running) when its kind may run twice
(`RESENDABLE`: a batch keeps its ids, and its device answers a repeat from its record); any other
kind is answered with an error saying it may have run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from tether.errors import ServerError
from tether.server.cluster.link import Link, Links, Lookup

if TYPE_CHECKING:
    from redis.asyncio import Redis

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
class _Waiting:
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


class Bus:
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
        # kind -> called with (request body, reply body) when a reply could not be sent (the backplane is
        # down): what the asker never hears must still be recorded (a batch's outcome, in the audit)
        self.undelivered: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {}
        # called with the body of an answer that came after its request gave up (read once the backplane
        # is back): what this node's caller was told was pending is recorded from it
        self.unclaimed: Callable[[dict[str, Any]], None] | None = None
        self._waiting: dict[str, _Waiting] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._reader_task: asyncio.Task[None] | None = None
        self._last_id = "$"
        self._stopping = False
        self.links = Links(node, self._dispatch, self._link_lost, lookup, read_secret, max_frame=max_frame,
                           elsewhere=self._through_redis) if lookup is not None and read_secret is not None else None

    @property
    def stopping(self) -> bool:
        """This node is stopping (its handlers are being cancelled for that, not by their askers)."""
        return self._stopping

    @staticmethod
    def inbox(node: str) -> str:
        return f"{PREFIX}:inbox:{node}"

    async def start(self) -> None:
        """Read the inbox from now on. With Redis away this still starts: the read loop keeps trying,
        and reads what arrives once it is back (requests sent meanwhile could not be sent)."""
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                info = await self.redis.xinfo_stream(self.inbox(self.node)) if await self.redis.exists(
                    self.inbox(self.node)) else None
            self._last_id = _text(info["last-generated-id"]) if info else "0-0"
        except Exception as exc:
            log.warning("cluster bus: cannot read %s yet (%s)", self.inbox(self.node), exc)
            self._last_id = "$"
        self._reader_task = asyncio.create_task(self._read_loop(), name=f"bus-reader-{self.node}")

    async def aclose(self) -> None:
        # A blocked XREAD is not cancelled: redis-py can swallow a cancellation that lands in a read
        # and retry the command (seen here: the task stayed "cancelling" inside a new XREAD). The
        # reader's connections are closed instead, which ends the read with an error the loop sees.
        self._stopping = True
        for task in list(self._running.values()):
            task.cancel()
        if self.links is not None:
            await self.links.aclose()
        with contextlib.suppress(Exception):
            await self.reader.connection_pool.disconnect()
        if self._reader_task is not None:
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):  # a read ends at once; a backoff sleep is cut
                    await self._reader_task
            except (TimeoutError, asyncio.CancelledError, Exception):
                self._reader_task.cancel()
        for waiting in self._waiting.values():
            waiting.deliver({"t": "done", "error": "this node is stopping"})

    async def request(self, node: str, kind: str, body: dict[str, Any],
                      timeout: float, *, rid: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """Ask `node`; yields each partial reply's body, then the final body. Raises BusError on an
        error reply or when `timeout` passes with no final reply; leaving early cancels the request
        on the other node. The deadline covers only the waits, never the caller's work between
        yields (a timeout scope must not span a yield). `rid` (default: a new one) names it for
        `interrupt`."""
        rid = rid or secrets.token_hex(8)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        waiting = self._waiting[rid] = _Waiting(queue, node=node)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        finished = False
        try:
            waiting.message = {"t": "req", "rid": rid, "from": self.node, "kind": kind, "body": body}
            await self._send(node, waiting.message, waiting)
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        message = await queue.get()
                except TimeoutError:
                    raise BusError(f"node {node} did not answer {kind} within {timeout:g} s") from None
                if message["t"] == "part":
                    yield message["body"]
                    continue
                if message["t"] == "interrupt":
                    raise BusInterrupted(f"the request to node {node} was given up")
                finished = True
                if "error" in message:
                    raise BusError(message["error"])
                yield message["body"]
                return
        finally:
            self._waiting.pop(rid, None)
            if not finished:  # the asker gave up or timed out: stop the work on the other node
                with contextlib.suppress(Exception):
                    await self._send(node, {"t": "cancel", "rid": rid, "from": self.node})

    def interrupt(self, rid: str) -> None:
        """Stop waiting on the request `rid` (it raises `BusInterrupted`, and the other node is told to
        stop): cheaper than racing every request against a second waiter."""
        waiting = self._waiting.get(rid)
        if waiting is not None:
            waiting.deliver({"t": "interrupt"})

    async def ask(self, node: str, kind: str, body: dict[str, Any], timeout: float, *, rid: str,
                  on_part: Callable[[dict[str, Any]], None],
                  on_done: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Ask `node` as `request` does, but each partial reply's body goes to `on_part` as it arrives, and the
        final body to `on_done` the moment it arrives (both called from the reader: they must not block), and
        is returned: one wait for the whole request, with no queue or generator turn per message. Raises
        BusInterrupted (`interrupt(rid)`) and BusError (an error reply, or no final reply within `timeout`);
        leaving early cancels it on the other node."""
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        waiting = self._waiting[rid] = _Waiting(node=node, on_part=on_part, on_done=on_done, answer=answer)
        finished = False
        try:
            waiting.message = {"t": "req", "rid": rid, "from": self.node, "kind": kind, "body": body}
            await self._send(node, waiting.message, waiting)
            try:
                async with asyncio.timeout(timeout):
                    message = await answer
            except TimeoutError:
                raise BusError(f"node {node} did not answer {kind} within {timeout:g} s") from None
            if message["t"] == "interrupt":
                raise BusInterrupted(f"the request to node {node} was given up")
            finished = True
            if "error" in message:
                raise BusError(message["error"])
            body = message["body"]
            return body if isinstance(body, dict) else {}
        finally:
            self._waiting.pop(rid, None)
            if not finished and answer.done() and not answer.cancelled() and answer.result().get("t") == "done":
                finished = True  # cancelled once its answer was in: nothing runs there any more
            if not finished:  # the asker gave up or timed out: stop the work on the other node
                with contextlib.suppress(Exception):
                    await self._send(node, {"t": "cancel", "rid": rid, "from": self.node})

    async def call(self, node: str, kind: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """A request whose partial replies are not wanted: the final body."""
        final: dict[str, Any] = {}
        async for final in self.request(node, kind, body, timeout):  # noqa: B007 - the last one is the answer
            pass
        return final

    async def publish(self, channel: str, event: dict[str, Any]) -> None:
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            await self.redis.publish(f"{PREFIX}:events:{channel}", _encode(event))

    async def _send(self, node: str, message: dict[str, Any], waiting: _Waiting | None = None) -> None:
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

    async def _resend(self, node: str, waiting: _Waiting) -> None:
        try:
            await self._send_redis(node, waiting.message)
        except BusError as exc:
            waiting.deliver({"t": "done", "error": f"the link to node {node} dropped before it answered, "
                                                   f"and the request could not be sent again: {exc}"})

    async def _send_redis(self, node: str, message: dict[str, Any]) -> None:
        text = _encode(message)
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await self.redis.xadd(self.inbox(node), {"m": text}, maxlen=INBOX_MAXLEN, approximate=True)
        except TimeoutError:
            raise BusError(f"cluster backplane unavailable: Redis did not take a message for node {node} "
                           f"within {REDIS_TIMEOUT_S:g} s") from None
        except Exception as exc:
            raise BusError(f"cluster backplane unavailable: Redis refused a message for node {node}: {exc}") from exc

    async def _read_loop(self) -> None:
        backoff = 0.1
        while not self._stopping:
            try:
                # RESP2, the client's protocol here, answers [[stream, [(id, fields), …]], …] (or None when
                # the block ran out); redis-py types every protocol's answer in one union
                batches = cast(list[list[Any]] | None, await self.reader.xread(
                    {self.inbox(self.node): self._last_id}, block=READ_BLOCK_MS, count=500))
                if backoff > 0.1:
                    log.warning("cluster bus: reading %s again", self.inbox(self.node))
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarting or unreachable: keep trying; said once, not per try
                if self._stopping:
                    return
                (log.warning if backoff == 0.1 else log.debug)(
                    "cluster bus: reading %s failed (%s); retrying with backoff", self.inbox(self.node), exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            for _, entries in batches or ():
                for entry_id, fields in entries:
                    self._last_id = _text(entry_id)
                    try:
                        message = json.loads(fields[b"m"] if b"m" in fields else fields["m"])
                    except (KeyError, ValueError) as exc:
                        log.warning("cluster bus: unreadable message %s dropped (%s)", self._last_id, exc)
                        continue
                    self._dispatch(message)
            if batches:  # let the woken askers and new handlers run before this task sends the next XREAD
                await asyncio.sleep(0)

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("t")
        rid = str(message.get("rid", ""))
        if kind in ("part", "done"):
            waiting = self._waiting.get(rid)
            if waiting is not None:
                waiting.deliver(message)
            elif kind == "done" and self.unclaimed is not None and isinstance(message.get("body"), dict):
                try:
                    self.unclaimed(message["body"])
                except Exception:
                    log.exception("recording the late answer to request %s failed", rid)
        elif kind == "req":
            if rid in self._running:  # sent again (its link dropped) while it runs here: answered once
                return
            task = asyncio.create_task(self._answer(message), name=f"bus-answer-{rid}")
            self._running[rid] = task
            task.add_done_callback(lambda _t: self._running.pop(rid, None))
        elif kind == "cancel":
            running = self._running.get(rid)
            if running is not None:
                running.cancel()

    async def _answer(self, message: dict[str, Any]) -> None:
        rid, asker, kind = message["rid"], message["from"], message.get("kind", "")

        async def send_part(body: dict[str, Any]) -> None:
            await self._send(asker, {"t": "part", "rid": rid, "body": body})

        handler = self.handlers.get(kind)
        reply: dict[str, Any]
        try:
            if handler is None:
                raise BusError(f"node {self.node} has no handler for {kind!r}")
            reply = {"t": "done", "rid": rid, "body": await handler(message.get("body") or {}, send_part)}
        except asyncio.CancelledError:
            return  # the asker gave up; it expects nothing more
        except Exception as exc:
            reply = {"t": "done", "rid": rid, "error": str(exc) or type(exc).__name__}
        try:
            await self._send(asker, reply)
        except Exception as exc:
            on_lost = self.undelivered.get(kind)
            if on_lost is not None and "body" in reply:
                log.warning("the answer to %s request %s from node %s was lost (%s): recorded here", kind, rid,
                            asker, exc)
                try:
                    on_lost(message.get("body") or {}, reply["body"])
                except Exception:
                    log.exception("recording the lost answer to %s request %s failed", kind, rid)


def _encode(message: dict[str, Any]) -> str:
    text = json.dumps(message, separators=(",", ":"))
    if len(text) > MAX_MESSAGE_BYTES:
        raise BusError(f"a cluster message of {len(text)} bytes is over the {MAX_MESSAGE_BYTES}-byte cap")
    return text


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
