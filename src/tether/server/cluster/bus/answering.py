"""The answering side of a node's bus: each message that arrives (over a link or through the inbox) handed
to its waiting request, or run by the handler of its kind and answered."""

from __future__ import annotations

import asyncio
from typing import Any

from tether.server.cluster.bus.core import BusCore
from tether.server.cluster.bus.messages import BusError, log


class AnsweringBus(BusCore):
    """`Bus`'s methods that take what arrives and answer requests."""

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
