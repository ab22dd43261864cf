"""The holding node's side of a crossing batch: another node's batch, request, cancel or answer for a
device held here, run through this node's hub (never onwards)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from tether.protocol.messages import Event, ServerMessage, ServerMessageType
from tether.server.aip.batches.ledger import TokenRef
from tether.server.cluster.bus import BusError
from tether.server.cluster.routing.core import ANSWER_TIMEOUT_S, NOT_HERE, RESULTS, RouterCore
from tether.server.trust.approvals import ApprovalRefused


class HoldingSide(RouterCore):
    """`Router`'s methods answering other nodes for devices held here."""

    async def serve_request(self, body: dict[str, Any], send: Any) -> dict[str, Any]:
        message = ServerMessage.model_validate_json(str(body.get("message") or "{}"))
        if message.type not in (ServerMessageType.POLICY_REQUEST, ServerMessageType.POLICY_SET,
                                ServerMessageType.OUTCOME_QUERY):
            raise BusError(f"node {self.node} forwards policy and outcome requests only, not {message.type.value}")
        timeout = min(float(body.get("timeout") or 30.0), 300.0)
        try:
            answer = await self.hub.request(str(body.get("device", "")), message, timeout, here_only=True)
        except LookupError as exc:
            return {"error": str(exc)}
        except TimeoutError:
            return {"error": f"device {body.get('device')} did not answer within {timeout:g}s", "timeout": True}
        return {"answer": answer.model_dump_json()}

    async def serve_batch(self, body: dict[str, Any], send: Callable[[dict[str, Any]], Awaitable[None]]
                          ) -> dict[str, Any]:
        """Another node's batch for a device held here: run it through this hub (never onwards)."""
        hub = self.hub
        device = str(body.get("device", ""))
        message = ServerMessage.model_validate_json(str(body.get("message") or "{}"))
        if message.type is not ServerMessageType.COMMAND:
            raise BusError(f"node {self.node} runs command batches only, not {message.type.value}")
        if not hub.holds(device):
            raise BusError(f"{NOT_HERE}: device {device} is not connected to node {self.node}")
        events: asyncio.Queue[Event | None] | None = None  # made with the first event: most batches have none
        pumper: asyncio.Task[None] | None = None

        async def pump(events: asyncio.Queue[Event | None]) -> None:
            while (event := await events.get()) is not None:
                await send({"event": event.model_dump(mode="json", exclude_none=True)})

        def on_event(event: Event) -> None:  # the pump starts with the first event
            nonlocal pumper, events
            if events is None:
                events = asyncio.Queue()
                pumper = asyncio.create_task(pump(events))
                self._keep(pumper)
            events.put_nowait(event)

        batch = hub.pending(message.response_id)
        if batch is not None and batch.device == device:  # sent here again (the device moved back and forth)
            batch.on_event = on_event
        else:
            batch = await hub.send_batch(device, message, on_event=on_event, here_only=True,
                                         asker=TokenRef.from_dict(body.get("asker")))
            batch.origin = str(body.get("from") or "another node")
        limit = (message.timeout or self.settings.default_command_timeout) + self.settings.grace_period + 5
        try:
            async with asyncio.timeout(limit):
                await batch.done.wait()
        except TimeoutError:
            await hub.cancel(message.response_id, f"node {self.node} timed out after {limit:g}s")
        except asyncio.CancelledError:  # the asking node gave up (its caller's timeout or cancel)
            if pumper is not None:
                pumper.cancel()
            if self.bus.stopping:  # this node stops: the device keeps running it, and the asking node sends
                raise  # it again, same ids, to the node the device moves to (it heard this one leave)
            if hub.holds(device):  # else the device is another node's now, and so is the batch: no CANCEL
                await hub.cancel(message.response_id, "cancelled by the node that sent the batch")
            else:
                hub.finish_remote(batch, [], "cancelled by the node that sent the batch")
            raise
        if pumper is not None and events is not None:  # the events first, then the results, in the device's order
            events.put_nowait(None)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(ANSWER_TIMEOUT_S):
                    await pumper
        self._answered_for(str(body.get("from") or ""), device, message.response_id, batch)
        # the device and batch named too: an answer that comes after the asking node gave up is still recorded
        return {"results": RESULTS.dump_json(list(batch.results.values())).decode(), "error": batch.error,
                "device": device, "response_id": message.response_id}

    async def serve_cancel(self, body: dict[str, Any], send: Any) -> dict[str, Any]:
        cancelled = await self.hub.cancel(str(body.get("response_id", "")), str(body.get("reason") or "cancelled"))
        return {"cancelled": cancelled}

    async def serve_answer(self, body: dict[str, Any], send: Any) -> dict[str, Any]:
        """Another node's answer to a question of a device held here: checked here too (the answerer the
        body names against the batch's caller) before it goes to the device."""
        content = body.get("content")
        try:
            answered = await self.hub.answer_question(str(body.get("device", "")), str(body.get("question", "")),
                                                      str(body.get("action", "")),
                                                      content if isinstance(content, dict) else None,
                                                      by=str(body.get("by") or "another node"),
                                                      answerer=TokenRef.from_dict(body.get("answerer")))
        except ApprovalRefused as exc:
            return {"refused": str(exc)}
        return {"answered": answered}
