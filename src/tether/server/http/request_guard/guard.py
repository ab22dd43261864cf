"""`RequestGuard`: the ASGI middleware every request passes (see the package docstring)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from tether.errors import ServerError
from tether.server.http.ratelimit import Throttles
from tether.server.http.request_guard.answers import send_error
from tether.server.http.request_guard.hosts import HostRules
from tether.server.http.request_guard.requests import LOGIN_SUFFIX, ASGIApp, Message, Scope, client_address
from tether.server.http.request_guard.throttling import answer_throttled, counting_failures, throttled_by
from tether.server.settings import ANONYMOUS_BODY_BYTES, ServerSettings

TokenCheck = Callable[[str], Awaitable[bool]]


class RequestGuard:
    """The ASGI middleware (see the module docstring). `await api_token_ok(secret)` says whether a bearer
    secret is a valid API token; it decides which body cap applies."""

    def __init__(self, app: ASGIApp, *, settings: ServerSettings, api_token_ok: TokenCheck) -> None:
        self.app = app
        self.rules = HostRules(settings.host, settings.allowed_hosts, settings.allowed_origins)
        self.max_body = settings.max_body_bytes
        self.anonymous_body = min(ANONYMOUS_BODY_BYTES, settings.max_body_bytes)
        self.api_token_ok = api_token_ok
        self._throttles: Throttles | None = None

    def __call__(self, scope: Scope, receive: Callable[[], Any], send: Callable[[Message], Any]) -> Awaitable[None]:
        """The awaitable that answers the request: the app's own coroutine when the request passes, so that
        no frame of the guard's stays in the chain every `await` of the request resumes through (a REST
        command suspends three or four times)."""
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return self.app(scope, receive, send)
        raw = scope.get("headers") or ()
        headers = dict(raw)
        refusal = self.rules.check(headers, raw, scope.get("scheme", "http"))
        if refusal is not None:
            return self.rules.refuse(scope, send, refusal, headers, receive)
        throttles = self._throttles
        if throttles is None:  # the app's (front.ServerApp.throttles), found on the first request
            throttles = self._throttles = getattr(scope.get("app"), "throttles", None)
        if throttles is not None:
            path: str = scope["path"]
            if kind == "http" and scope["method"] == "POST" and ("/pairing/" in path or path.endswith(LOGIN_SUFFIX)):
                throttled = throttled_by(throttles, scope, headers)  # a pairing claim, a dashboard login
                if throttled is not None:
                    return answer_throttled(scope, receive, send, headers, throttled)
                send = counting_failures(send, throttles, client_address(scope))
            elif b"authorization" in headers:  # the common case, kept short: it is every API request
                client = scope.get("client")
                address = str(client[0]) if client else ""
                if address in throttles.auth_failures and (throttled := throttles.credentials_blocked(address)):
                    return answer_throttled(scope, receive, send, headers, throttled)
                if kind == "http":
                    send = counting_failures(send, throttles, address)
        if kind == "http":
            return self._http(scope, receive, send, headers)
        return self.app(scope, receive, send)

    # -- bodies ----------------------------------------------------------------------------------

    async def _cap(self, headers: dict[bytes, bytes]) -> int:
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, secret = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and secret.strip() and await self.api_token_ok(secret.strip()):
            return self.max_body
        return self.anonymous_body

    async def _declared(self, scope: Scope, receive: Callable[[], Any], send: Callable[[Message], Any],
                        headers: dict[bytes, bytes], size: int) -> None:
        """A body of a declared length past the anonymous cap: the app, or 413 over the token's cap."""
        cap = await self._cap(headers)
        if size > cap:
            await send_error(send, 413, self._too_large(size, cap))
            return
        await self.app(scope, receive, send)

    async def _chunked(self, scope: Scope, receive: Callable[[], Any], send: Callable[[Message], Any],
                       headers: dict[bytes, bytes]) -> None:
        await self._counted(scope, receive, send, await self._cap(headers))

    def _too_large(self, size: int | None, cap: int) -> str:
        what = f"{size} bytes" if size is not None else "the request body"
        if cap < self.max_body:
            return (f"{what} is more than the {_size(cap)} accepted without a valid API token "
                    "('Authorization: Bearer <api token>')")
        return f"{what} is more than the {_size(cap)} limit (server setting max_body_bytes)"

    def _http(self, scope: Scope, receive: Callable[[], Any], send: Callable[[Message], Any],
              headers: dict[bytes, bytes]) -> Awaitable[None]:
        declared = headers.get(b"content-length")
        if declared is not None:
            text = declared.decode("latin-1").strip()
            if not text.isdigit():
                return send_error(send, 400, "invalid Content-Length header")
            size = int(text)
            if size <= self.anonymous_body:  # the server reads exactly that much: nothing to count
                return self.app(scope, receive, send)
            return self._declared(scope, receive, send, headers, size)
        if b"transfer-encoding" not in headers:  # neither length nor chunks: no body at all
            return self.app(scope, receive, send)
        if b"authorization" in headers:
            return self._chunked(scope, receive, send, headers)
        return self._counted(scope, receive, send, self.anonymous_body)

    async def _counted(self, scope: Scope, receive: Callable[[], Any], send: Callable[[Message], Any],
                       cap: int) -> None:
        """A body without a declared length (chunked): count what arrives, stop at the cap."""
        seen = 0
        over = False
        started = False

        async def counted_receive() -> Message:
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap:
                    over = True
                    raise BodyTooLarge(self._too_large(None, cap))
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over:  # the app answered something else about the body it could not read: ours wins
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except BodyTooLarge:
            pass
        if over and not started:
            await send_error(send, 413, self._too_large(None, cap))


class BodyTooLarge(ServerError):
    """Raised into the app from `receive` when a streamed body passes the cap."""


def _size(n: int) -> str:
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)} MiB"
    if n % 1024 == 0:
        return f"{n // 1024} KiB"
    return f"{n} bytes"
