"""The asking side of a node's bus: requests to other nodes, their partial replies and answers."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from tether.server.cluster.bus.core import BusCore
from tether.server.cluster.bus.messages import BusError, BusInterrupted, Waiting


class AskingBus(BusCore):
    """`Bus`'s methods that ask other nodes."""

    async def request(self, node: str, kind: str, body: dict[str, Any],
                      timeout: float, *, rid: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """Ask `node`; yields each partial reply's body, then the final body. Raises BusError on an
        error reply or when `timeout` passes with no final reply; leaving early cancels the request
        on the other node. The deadline covers only the waits, never the caller's work between
        yields (a timeout scope must not span a yield). `rid` (default: a new one) names it for
        `interrupt`."""
        rid = rid or secrets.token_hex(8)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        waiting = self._waiting[rid] = Waiting(queue, node=node)
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
        waiting = self._waiting[rid] = Waiting(node=node, on_part=on_part, on_done=on_done, answer=answer)
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
