"""The SDK's streamable-HTTP transport, answering a request with one JSON body unless it has to stream.

The SDK chooses per server: every POST is answered with an SSE stream (what progress, elicitation and the
request's notifications need), or every POST with a JSON body (then none of those can reach the client).
Most gateway calls have nothing to say before their result, and the SSE answer costs both sides a stream
(here: a task group, two memory streams and a writer task; in the client: an event parser) that a JSON
body does not: measured in bench/gateway.py, the bare SDK server's no-op call takes about twice as long
with SSE answers as in its JSON mode (both ends in one process).

So the gateway decides per request, late: the request is handed to the session and the transport waits
for the first message the session sends on that request's stream. The response itself goes back as a JSON
body; anything else (a progress notification, an elicitation request, a log message) opens the SSE stream,
that message first, and the rest follows as the SDK streams it. A call that has sent nothing for
`STREAM_AFTER` seconds opens the SSE stream too, so its keep-alive pings hold the client's read timeout off
as before. A cancelled request gets no answer at all, as MCP says: its SSE stream ends without one
(`_Uncancelled`). The client offered both (its `Accept` header) as the spec requires, so it reads either.

Everything else (initialize, notifications, GET and DELETE, malformed requests, an event store) takes the
SDK's own path unchanged. Written against mcp 2.3's transport (`_request_streams`, `_run_sse_writer`,
`_create_session_message`, `handle_request`) and manager (`_admit_session`, `_server_instances`,
`_session_owners`, `_task_group`); tests/gateway/test_gateway_replies.py and test_gateway_sessions.py fail
if they change shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Any
from uuid import uuid4

import anyio
import pydantic_core
from anyio.streams.memory import MemoryObjectSendStream
from mcp.server.auth.middleware.bearer_auth import AuthorizationContext
from mcp.server.streamable_http import (
    CONTENT_TYPE_SSE,
    GET_STREAM_KEY,
    MCP_SESSION_ID_HEADER,
    REQUEST_CANCELLED,
    REQUEST_STREAM_BUFFER_SIZE,
    EventMessage,
    StreamableHTTPServerTransport,
    check_accept_headers,
)
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.inbound import MCP_PROTOCOL_VERSION_HEADER
from mcp_types import (
    DEFAULT_NEGOTIATED_VERSION,
    JSONRPCError,
    JSONRPCRequest,
    JSONRPCResponse,
    jsonrpc_message_adapter,
)
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

STREAM_AFTER = 5.0  # seconds a call may stay silent before its answer becomes an SSE stream (with pings)


class _FirstSignal:
    """The send end of one request's stream, noting that a first message arrived without receiving it: a
    receive cancelled by a timeout could lose the message it was being handed (anyio 4's memory streams)."""

    def __init__(self, inner: MemoryObjectSendStream[EventMessage]) -> None:
        self.inner = inner
        self.arrived = asyncio.Event()

    async def send(self, item: EventMessage) -> None:
        await self.inner.send(item)
        self.arrived.set()

    def close(self) -> None:
        self.inner.close()
        self.arrived.set()

    async def aclose(self) -> None:
        await self.inner.aclose()
        self.arrived.set()


class ReplyingTransport(StreamableHTTPServerTransport):
    """A session's transport: a request's answer is a JSON body unless something must be streamed first.

    It also notes when its session was last used (`last_used`, monotonic seconds, at the start and end of
    every HTTP request) and how many POSTs it is serving now (`posts_in_flight`): what the manager's eviction
    of idle sessions reads. An open GET stream (a client listening for notifications) is not a POST."""

    stream_after: float = STREAM_AFTER
    last_used: float = 0.0
    posts_in_flight: int = 0

    async def handle_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        post = scope.get("method") == "POST"
        self.last_used = time.monotonic()
        self.posts_in_flight += post
        try:
            await super().handle_request(scope, receive, send)
        finally:
            self.posts_in_flight -= post
            self.last_used = time.monotonic()

    async def _handle_post_request(self, scope: Scope, request: Request, receive: Receive, send: Send) -> None:
        message = await self._plain_request(request)
        writer = self._read_stream_writer
        if message is None or writer is None:
            await super()._handle_post_request(scope, request, receive, send)
            return
        if not await self._validate_request_headers(request, send):
            return
        request_id = str(message.id)
        outbox, reader = anyio.create_memory_object_stream[EventMessage](REQUEST_STREAM_BUFFER_SIZE)
        signal = _FirstSignal(outbox)
        self._request_streams[request_id] = (signal, reader)  # type: ignore[assignment]  # (send/close/aclose)
        version = request.headers.get(MCP_PROTOCOL_VERSION_HEADER, DEFAULT_NEGOTIATED_VERSION)
        first: EventMessage | None = None
        try:
            await writer.send(self._create_session_message(message, request, request_id, version))
            async with asyncio.timeout(self.stream_after):
                await signal.arrived.wait()
            first = reader.receive_nowait()
        except TimeoutError:
            pass
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.WouldBlock):
            await self._clean_up_memory_streams(request_id)  # the session ended: the stream below ends at once
        except BaseException:
            await self._clean_up_memory_streams(request_id)
            raise
        if first is not None and _is_result(first.message):
            await self._clean_up_memory_streams(request_id)
            await self._create_json_response(first.message)(scope, receive, send)
            return
        stream: Any = _Uncancelled(reader)
        if first is not None and _is_cancelled(first.message):  # no answer to a cancelled request
            await self._clean_up_memory_streams(request_id)
            first, stream = None, _Ended()
        await self._stream(request_id, first, stream, scope, receive, send)

    async def _plain_request(self, request: Request) -> JSONRPCRequest | None:
        """The POST's JSON-RPC request when this transport answers it itself; None leaves it to the SDK."""
        if self.is_json_response_enabled or self._event_store is not None or not self._check_content_type(request):
            return None
        has_json, has_sse = check_accept_headers(request)
        if not (has_json and has_sse):  # the SDK refuses it (406)
            return None
        body = await request.body()  # Starlette keeps it, so the SDK's path reads the same bytes again
        try:
            message = jsonrpc_message_adapter.validate_python(pydantic_core.from_json(body), by_name=False)
        except (ValueError, ValidationError):
            return None
        if not isinstance(message, JSONRPCRequest) or message.method == "initialize":
            return None
        return message

    async def _stream(self, request_id: str, first: EventMessage | None, reader: Any,
                      scope: Scope, receive: Receive, send: Send) -> None:
        """The SDK's SSE answer for a request already handed to the session, `first` (taken off its stream
        to decide) sent before the rest: `_run_sse_writer` sends its `priming_event` first."""
        sse_writer, sse_reader = anyio.create_memory_object_stream[dict[str, Any]](0)
        self._sse_stream_writers[request_id] = sse_writer
        headers = {"Cache-Control": "no-cache, no-transform", "Connection": "keep-alive",
                   "Content-Type": CONTENT_TYPE_SSE,
                   **({MCP_SESSION_ID_HEADER: self.mcp_session_id} if self.mcp_session_id else {})}
        opening = self._create_event_data(first) if first is not None else None
        response = EventSourceResponse(content=sse_reader, headers=headers, data_sender_callable=partial(
            self._run_sse_writer, request_id, sse_writer, reader, opening))
        try:
            await response(scope, receive, send)
        finally:
            await sse_writer.aclose()
            await sse_reader.aclose()


def _is_result(message: Any) -> bool:
    """A request's own answer, to go back as JSON. Not the SDK's REQUEST_CANCELLED error (never sent, see
    `_Uncancelled`), nor the end of a session: an answer that is not one goes on an SSE stream, because mcp
    2.3's client fails (an exception out of its task group) on a JSON answer that arrives after its session
    closed, and drops a late SSE one quietly; a client that gives up a call cancels it and often closes its
    session right after."""
    if isinstance(message, JSONRPCResponse):
        return True
    return isinstance(message, JSONRPCError) and message.error.code != REQUEST_CANCELLED


def _is_cancelled(message: Any) -> bool:
    return isinstance(message, JSONRPCError) and message.error.code == REQUEST_CANCELLED


class _Uncancelled:
    """A request's stream as the SSE writer reads it, ending where the SDK would send its REQUEST_CANCELLED
    error: MCP (2025-11-25, cancellation) says a cancelled request gets no response, so its SSE stream ends
    with none (what it sent before, progress, stays sent)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __aenter__(self) -> _Uncancelled:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self.inner.__aexit__(*exc)

    def __aiter__(self) -> _Uncancelled:
        return self

    async def __anext__(self) -> EventMessage:
        message: EventMessage = await self.inner.__anext__()
        if _is_cancelled(message.message):
            raise StopAsyncIteration
        return message


class _Ended:
    """A request stream that has nothing more (its only message was the cancellation, taken off)."""

    async def __aenter__(self) -> _Ended:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    def __aiter__(self) -> _Ended:
        return self

    async def __anext__(self) -> EventMessage:
        raise StopAsyncIteration


class ReplyingSessionManager(StreamableHTTPSessionManager):
    """The SDK's session manager, its sessions served by `ReplyingTransport`, at most `per_owner` of them
    open for one owner (the token's id, `client_id` of the session's `AuthorizationContext`).

    An owner at its limit gets a new session in place of its least recently used idle one (`make_room`):
    clients that end without a DELETE (the TypeScript SDK's `close()`) would otherwise hold their sessions
    until the idle expiry and lock their token out. Only when every session of the owner is serving a POST
    is a new one refused."""

    stream_after: float = STREAM_AFTER  # given to each new session's transport
    per_owner: int | None = None

    def owned_by(self, owner: str) -> dict[str, StreamableHTTPServerTransport]:
        """The open sessions of `owner` (a token's id), by session id."""
        return {sid: self._server_instances[sid] for sid, who in list(self._session_owners.items())
                if who.get("client_id") == owner and sid in self._server_instances}

    def make_room(self, owner: str) -> bool:
        """Whether `owner` may open one more session now, after ending (at once, without awaiting) its least
        recently used session with no POST in flight if it is at `per_owner`: one with no request at all
        first, then one that only holds a GET stream open. False when all of them are serving a POST."""
        if self.per_owner is None:
            return True
        mine = self.owned_by(owner)
        if len(mine) < self.per_owner:
            return True
        idle = [(getattr(t, "posts_in_flight", 0) > 0, GET_STREAM_KEY in t._request_streams,
                 getattr(t, "last_used", 0.0), sid, t) for sid, t in mine.items()]
        candidates = sorted(entry for entry in idle if not entry[0])
        excess = len(mine) - self.per_owner + 1
        if len(candidates) < excess:
            return False
        for _, _, _, sid, transport in candidates[:excess]:
            self._evict(sid, transport)
        return True

    def _evict(self, session_id: str, transport: StreamableHTTPServerTransport) -> None:
        # `_discard_session` without its await: forgotten now (its id answers 404 from here on), the transport
        # terminated in the manager's task group (which ends the session's server task)
        self._server_instances.pop(session_id, None)
        self._session_owners.pop(session_id, None)
        if self._task_group is not None and not transport.is_terminated:
            self._task_group.start_soon(transport.terminate)
        logger.info("MCP session %s evicted: its token opened a new one and this was its least recently used",
                    session_id[:12])

    def _admit_session(self, requestor: AuthorizationContext | None) -> StreamableHTTPServerTransport | None:
        # mcp 2.3's `_admit_session`, constructing the transport above, after making room for its owner
        if requestor is not None and not self.make_room(str(requestor.get("client_id"))):
            return None
        if self.max_sessions is not None and len(self._server_instances) >= self.max_sessions:
            return None
        transport = ReplyingTransport(mcp_session_id=uuid4().hex, is_json_response_enabled=self.json_response,
                                      event_store=self.event_store, security_settings=self.security_settings,
                                      retry_interval=self.retry_interval, idle_timeout=self.session_idle_timeout)
        transport.stream_after = self.stream_after
        session_id = transport.mcp_session_id
        assert session_id is not None
        if requestor is not None:
            self._session_owners[session_id] = requestor
        self._server_instances[session_id] = transport
        return transport
