"""What external MCP servers ask through a device while a batch runs, and who answers.

An elicitation (a question for a person) arrives as an event of the batch; `OpenQuestions` remembers
which batch of which device asked it, so that a person's answer (`tether answer`, the dashboard) goes
to the batch still waiting for it and to no other. A sampling request (a completion from the server's
LLM) is answered by `answer_sampling` with the sampler the agent layer sets, bounded in time, and
refused with a reason when the server has no LLM.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tether.protocol.messages import ClientMessage, Event, ServerMessage, ServerMessageType, TaskStatus
from tether.server.aip.link import DeviceLink

MAX_OPEN_QUESTIONS = 1024  # elicitation questions remembered for answers, over all devices
SAMPLING_TIMEOUT = 120.0  # a device's sampling request to the server's LLM

Sampler = Callable[[str, dict[str, Any]], Awaitable[tuple[str, str]]]  # (device, request) → (text, model)

logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name


class OpenQuestions:
    """(device, question id) → the response_id of the batch that asked; the oldest go first when full."""

    def __init__(self, limit: int = MAX_OPEN_QUESTIONS) -> None:
        self.limit = limit
        self._open: dict[tuple[str, str], str] = {}

    def note(self, device: str, event: Event) -> None:
        """Remember a question the event asks, forget one it says was answered."""
        question = str(event.data.get("id", ""))[:64]
        if event.kind == "elicitation" and question and "declined" not in event.data:
            if len(self._open) >= self.limit:  # answered or not, the oldest go first
                del self._open[next(iter(self._open))]
            self._open[(device, question)] = event.response_id or ""
        elif event.kind == "elicitation_answered":
            self._open.pop((device, question), None)

    def batch_of(self, device: str, question: str) -> str | None:
        return self._open.get((device, question))

    def forget(self, device: str, question: str) -> None:
        self._open.pop((device, question), None)


async def answer_sampling(sampler: Sampler | None, conn: DeviceLink, msg: ClientMessage) -> None:
    """One sampling request of an external MCP server on `conn`'s device, answered by the LLM."""
    payload = msg.payload or {}
    reply = ServerMessage(type=ServerMessageType.SAMPLING_REPLY, response_id=msg.prev_response_id or "-",
                          status=TaskStatus.OK)
    if sampler is None:
        reply.status, reply.error = TaskStatus.FAILED, "this server has no LLM configured"
    else:
        try:
            async with asyncio.timeout(SAMPLING_TIMEOUT):
                text, model = await sampler(conn.name, payload)
        except Exception as exc:
            reply.status, reply.error = TaskStatus.FAILED, f"the server's LLM failed: {exc}"[:1000]
        else:
            reply.payload = {"text": text, "model": model}
    logger.info("sampling for MCP server %s on device %s (call %s): %s", str(payload.get("server"))[:64],
                conn.name, str(payload.get("call_id"))[:64], reply.error or "answered")
    await conn.send(reply)
