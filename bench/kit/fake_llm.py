"""A real HTTP server on 127.0.0.1 that speaks the OpenAI Chat Completions protocol, with scripted replies.

    async with FakeLLM(["first reply", lambda body: "second"]) as fake:
        client = LLMClient(fake.settings())
        ...
        fake.requests[0]["messages"]

Each scripted reply is a string, a callable taking the request body and returning a string, or an
`HTTPFailure(status, message)`; replies are used in order. `reject_json_schema=True` answers HTTP 400
to any request whose `response_format` is `json_schema` (without using up a reply). Streaming
requests get SSE chunks and, when `stream_options.include_usage` is set, a final usage chunk.
The server runs in-process as an asyncio task (uvicorn on a socket bound and listening before it starts,
so no waiting is needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tether.agent.llm.settings import LLMSettings


@dataclass
class HTTPFailure:
    status: int
    message: str = "scripted failure"


Reply = str | HTTPFailure | Callable[[dict[str, Any]], "str | HTTPFailure"]


def crude_tokens(text: str) -> int:
    return len(text) // 4


def prompt_tokens_of(body: dict[str, Any]) -> int:
    text = "".join(m.get("content") or "" if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
                   for m in body.get("messages", []))
    return crude_tokens(text)


def _error(status: int, message: str, error_type: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": None, "code": None}},
                        status_code=status)


class FakeLLM:
    """The scripted Chat Completions server; `requests` holds every request body received."""

    def __init__(self, replies: list[Reply] | None = None, *, reject_json_schema: bool = False,
                 model: str = "fake-model", chunk_size: int = 7) -> None:
        self.replies: list[Reply] = list(replies or [])
        self.reject_json_schema = reject_json_schema
        self.model = model
        self.chunk_size = chunk_size
        self.requests: list[dict[str, Any]] = []
        self.rejected: list[dict[str, Any]] = []
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self._sock: socket.socket | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def settings(self, **overrides: Any) -> LLMSettings:
        values: dict[str, Any] = {"base_url": self.base_url, "model": self.model, "api_key": "test-key",
                                  "max_retries": 0, "timeout": 10}
        values.update(overrides)
        return LLMSettings(**values)

    def add(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    # -- the app ---------------------------------------------------------------------------------

    async def _completions(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict) or "messages" not in body or "model" not in body:
            return _error(400, "model and messages are required")
        fmt = body.get("response_format") or {}
        if self.reject_json_schema and fmt.get("type") == "json_schema":
            self.rejected.append(body)
            return _error(400, "response_format json_schema is not supported by this server")
        self.requests.append(body)
        if not self.replies:
            return _error(500, "the fake LLM has no scripted reply left", "server_error")
        reply = self.replies.pop(0)
        if callable(reply):
            reply = reply(body)
        if isinstance(reply, HTTPFailure):
            kind = "server_error" if reply.status >= 500 else "invalid_request_error"
            return _error(reply.status, reply.message, kind)
        prompt_tokens = prompt_tokens_of(body)
        completion_tokens = crude_tokens(reply)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        ident = f"chatcmpl-{len(self.requests)}"
        created = int(time.time())
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._sse(ident, created, reply, usage if include_usage else None),
                                     media_type="text/event-stream")
        return JSONResponse({
            "id": ident, "object": "chat.completion", "created": created, "model": self.model,
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": reply}}],
            "usage": usage,
        })

    async def _sse(self, ident: str, created: int, text: str, usage: dict[str, int] | None) -> AsyncIterator[str]:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            data = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
            return f"data: {json.dumps(data)}\n\n"

        yield chunk({"role": "assistant", "content": ""})
        for start in range(0, len(text), self.chunk_size):
            yield chunk({"content": text[start:start + self.chunk_size]})
        yield chunk({}, "stop")
        if usage is not None:
            data = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": self.model,
                    "choices": [], "usage": usage}
            yield f"data: {json.dumps(data)}\n\n"
        yield "data: [DONE]\n\n"

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> FakeLLM:
        app = Starlette(routes=[Route("/v1/chat/completions", self._completions, methods=["POST"])])
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)  # connections queue from now on, so clients need not wait for uvicorn
        self._sock = sock
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # older uvicorn; harmless on newer ones
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        return self

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            self._server.force_exit = True  # do not wait out idle keep-alive connections
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close()
        self._server = self._task = self._sock = None

    async def __aenter__(self) -> FakeLLM:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (for connection-refused tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
