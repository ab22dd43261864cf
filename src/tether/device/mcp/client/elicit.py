"""Questions of external MCP servers asked through the device's server.

While a device serves a server, nobody sits at its terminal: a question an MCP server asks during a
call goes out as an `elicitation` event of the running command (`mcp.client_caps`), the caller sees
it on the command's stream and answers with `POST /api/v1/devices/{name}/questions/{id}`; the server
sends that answer back as an ELICITATION_ANSWER frame, which `answer` hands to the waiting call. An
answer for a question nobody waits for (answered already, timed out) is dropped with a log line.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

from tether.device.mcp.client.client_caps import ElicitationAnswer, ElicitationRequest, SamplingReply, SamplingRequest
from tether.protocol.codec import encode
from tether.protocol.messages import ClientMessage, ClientMessageType, ServerMessage, TaskStatus

logger = logging.getLogger(__name__)

MAX_OPEN_QUESTIONS = 256  # a server that asks in a loop cannot grow this without bound


class RemoteQuestions:
    """The questions of this device waiting for an answer from its server, by id."""

    def __init__(self) -> None:
        self._open: dict[str, asyncio.Future[ElicitationAnswer]] = {}

    def __len__(self) -> int:
        return len(self._open)

    async def elicit(self, request: ElicitationRequest) -> ElicitationAnswer:
        """Wait for the answer to `request` (its event is already on the command's stream); the caller
        (`ServerClientCaps`) bounds the wait with its timeout and cancels this on expiry."""
        if len(self._open) >= MAX_OPEN_QUESTIONS or request.id in self._open:
            return ElicitationAnswer("cancel")
        answer: asyncio.Future[ElicitationAnswer] = asyncio.get_running_loop().create_future()
        self._open[request.id] = answer
        try:
            return await answer
        finally:
            self._open.pop(request.id, None)

    def answer(self, payload: dict[str, Any] | None) -> bool:
        """Deliver an ELICITATION_ANSWER payload; False if nobody waits for it or it is malformed."""
        payload = payload or {}
        waiter = self._open.get(str(payload.get("id")))
        action = payload.get("action")
        content = payload.get("content")
        if waiter is None or waiter.done():
            logger.info("an answer to question %r arrived but nobody waits for it", payload.get("id"))
            return False
        if action not in ("accept", "decline", "cancel") or not (content is None or isinstance(content, dict)):
            logger.warning("a malformed answer to question %r: cancelled", payload.get("id"))
            waiter.set_result(ElicitationAnswer("cancel"))
            return False
        waiter.set_result(ElicitationAnswer(action, content if action == "accept" else None))
        return True


class RemoteSampler:
    """Sampling requests of external MCP servers, sent to the device's server (its LLM) as
    SAMPLING_REQUEST frames and answered by SAMPLING_REPLY; `send` queues a frame for the server."""

    def __init__(self, send: Callable[[str], None], client_id: str | None = None) -> None:
        self._send = send
        self._client_id = client_id
        self._open: dict[str, asyncio.Future[SamplingReply]] = {}

    async def sample(self, request: SamplingRequest) -> SamplingReply:
        """Ask and wait; the caller (`ServerClientCaps`) bounds the wait and turns errors into a refusal."""
        if len(self._open) >= MAX_OPEN_QUESTIONS:
            raise RuntimeError("too many sampling requests waiting for the server")
        ident = uuid.uuid4().hex
        reply: asyncio.Future[SamplingReply] = asyncio.get_running_loop().create_future()
        self._open[ident] = reply
        try:
            self._send(encode(ClientMessage(
                type=ClientMessageType.SAMPLING_REQUEST, client_id=self._client_id, prev_response_id=ident,
                payload={"server": request.server, "call_id": request.call_id, "messages": request.messages,
                         "system_prompt": request.system_prompt, "max_tokens": request.max_tokens,
                         "temperature": request.temperature})))
            return await reply
        finally:
            self._open.pop(ident, None)

    def reply(self, msg: ServerMessage) -> bool:
        waiter = self._open.get(msg.response_id)
        if waiter is None or waiter.done():
            logger.info("a sampling reply arrived but nobody waits for it")
            return False
        payload = msg.payload or {}
        if msg.status is TaskStatus.FAILED or not isinstance(payload.get("text"), str):
            waiter.set_exception(RuntimeError(msg.error or "the server sent no completion"))
        else:
            waiter.set_result(SamplingReply(text=payload["text"], model=str(payload.get("model", "?"))))
        return True
