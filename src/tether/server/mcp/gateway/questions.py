"""Questions to 2026-07-28 clients: a device call that asks something ends in an input-required result, and the
client's retry of the same call by the same token carries the answer (`_defer`, `_retry`)."""


from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

import mcp_types as types

from tether.protocol.models import Result
from tether.server.mcp.handlers.context import ELICIT_TIMEOUT
from tether.server.mcp.tools.tool_call import AskLater, Reply
from tether.server.mcp.tools.translate import call_result
from tether.server.store.tokens import TokenInfo

MAX_DEFERRED = 1024  # questions to 2026-07-28 clients awaiting their retry
QUESTION_KEY = "approval"


@dataclass(frozen=True)
class _Deferred:
    """A question put to a 2026-07-28 client, waiting for the retry of the same call by the same token."""

    token_id: str
    tool: str
    arguments: str
    held: Result
    expires: float


class GatewayQuestions:
    """The questions part of `tether.server.mcp.gateway.Gateway`, which sets `_deferred` (the questions waiting
    for their retry, by `request_state`) in its constructor."""

    _deferred: dict[str, _Deferred]

    def _defer(self, later: AskLater, token: TokenInfo, name: str, arguments: dict[str, Any]
               ) -> types.InputRequiredResult | types.CallToolResult:
        if later.held is None:
            return call_result(Reply(later.message, is_error=True))
        while len(self._deferred) >= MAX_DEFERRED:  # the oldest unanswered questions go first
            del self._deferred[next(iter(self._deferred))]
        state = secrets.token_urlsafe(18)
        self._deferred[state] = _Deferred(token.id, name, _fingerprint(arguments), later.held,
                                          time.monotonic() + ELICIT_TIMEOUT)
        ask = types.ElicitRequest(params=types.ElicitRequestFormParams(message=later.message,
                                                                       requested_schema=later.schema))
        return types.InputRequiredResult(input_requests={QUESTION_KEY: ask}, request_state=state)

    def _retry(self, params: types.CallToolRequestParams, token: TokenInfo, name: str,
               arguments: dict[str, Any]) -> tuple[Result, Any] | str:
        """The held result and the client's answer of a retried call, or why the retry cannot be used."""
        deferred = self._deferred.pop(params.request_state or "", None)
        answer = (params.input_responses or {}).get(QUESTION_KEY)
        if deferred is None or deferred.expires < time.monotonic() or deferred.token_id != token.id \
                or deferred.tool != name or deferred.arguments != _fingerprint(arguments):
            return "this answer belongs to no question waiting here (expired, answered, or another call's); call again"
        if answer is None or not hasattr(answer, "action"):
            return "the retried call carries no answer to the question it was asked; call again"
        reply = {"action": answer.action, "content": getattr(answer, "content", None)}

        async def answered(message: str, schema: dict[str, Any]) -> dict[str, Any]:
            return reply

        return deferred.held, answered


async def _ask_later(message: str, schema: dict[str, Any]) -> dict[str, Any]:
    raise AskLater(message, schema)


def _fingerprint(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, sort_keys=True, default=str)
