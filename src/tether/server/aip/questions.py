"""What external MCP servers ask through a device while a batch runs, and who answers.

An elicitation (a question for a person) arrives as an event of the batch — an external MCP server's, or
the device's own about a host a sandboxed command asks to reach (`ask: on-miss`); `OpenQuestions` remembers
which batch of which device asked it, so that a person's answer (`tether answer`, the dashboard) goes
to the batch still waiting for it and to no other; whether it asks for consent (`asks_consent`) decides
whether, with four-eyes on, its caller may answer it (server/approvals.py `check_answerer`). A sampling
request (a completion from the server's LLM) is answered by `answer_sampling` with the sampler the agent
layer sets, bounded in time, and refused with a reason when the server has no LLM.
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

# the answers to a question that asks for nothing but a yes or no (an enum of these words is a decision)
CONSENT_WORDS = frozenset({"yes", "no", "y", "n", "approve", "approved", "deny", "denied", "allow", "reject",
                           "accept", "decline", "confirm", "confirmed", "cancel", "ok", "proceed", "abort",
                           "once", "always"})  # "once"/"always": an approval for now or for good (egress ask)

Sampler = Callable[[str, dict[str, Any]], Awaitable[tuple[str, str]]]  # (device, request) → (text, model)

logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name


def asks_consent(schema: Any) -> bool:
    """Whether a question with this answer schema asks a person for consent (an approval) rather than for
    information: it asks for no field at all (accepting is the yes), or only for booleans (a confirmation),
    or for one choice among decision words ("approve"/"deny", "yes"/"no", `CONSENT_WORDS`). A form with
    any other field (a text, a number, a choice of other things) asks for information."""
    if not isinstance(schema, dict):
        return True
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not properties:
        return True
    kinds = [p if isinstance(p, dict) else {} for p in properties.values()]
    if all(p.get("type") == "boolean" for p in kinds):
        return True
    if len(kinds) == 1:
        options = kinds[0].get("enum") or [o.get("const") for o in kinds[0].get("oneOf") or [] if isinstance(o, dict)]
        return bool(options) and all(isinstance(o, str) and o.strip().lower() in CONSENT_WORDS for o in options)
    return False


class OpenQuestions:
    """(device, question id) → the response_id of the batch that asked and whether the question asks for
    consent (`asks_consent`); the oldest go first when full."""

    def __init__(self, limit: int = MAX_OPEN_QUESTIONS) -> None:
        self.limit = limit
        # (device, question) -> (response_id, asks consent, the host a sandboxed command asks to reach or None)
        self._open: dict[tuple[str, str], tuple[str, bool, dict[str, Any] | None]] = {}

    def note(self, device: str, event: Event) -> None:
        """Remember a question the event asks, forget one it says was answered."""
        question = str(event.data.get("id", ""))[:64]
        if event.kind == "elicitation" and question and "declined" not in event.data:
            if len(self._open) >= self.limit:  # answered or not, the oldest go first
                del self._open[next(iter(self._open))]
            egress = event.data.get("egress")
            target = {"host": str(egress.get("host"))[:255], "port": egress.get("port")} \
                if isinstance(egress, dict) else None
            self._open[(device, question)] = (event.response_id or "", asks_consent(event.data.get("schema")), target)
        elif event.kind == "elicitation_answered":
            self._open.pop((device, question), None)

    def batch_of(self, device: str, question: str) -> str | None:
        """The response_id of the batch that asked this open question, or None."""
        entry = self._open.get((device, question))
        return entry[0] if entry is not None else None

    def consent(self, device: str, question: str) -> bool:
        """Whether this open question asks for consent (`asks_consent`); True for one not known here."""
        entry = self._open.get((device, question))
        return entry[1] if entry is not None else True

    def egress(self, device: str, question: str) -> dict[str, Any] | None:
        """The host and port of an open `ask: on-miss` question (tools/shell/egress_ask.py), else None."""
        entry = self._open.get((device, question))
        return entry[2] if entry is not None else None

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
