"""`RequestGuard`: the rules every request meets before any route sees it, HTTP or WebSocket.

One pure ASGI middleware, so whatever HTTP surface the server grows (REST, AIP, tasks, a
dashboard, MCP over HTTP) gets the same rules without opting in:

- **Host** must name this server: the localhost names, the bind address, or `allowed_hosts`.
  A page on `evil.example` whose name an attacker re-points at 127.0.0.1 (DNS rebinding) sends
  `Host: evil.example` and is refused with 403.
- **Origin**, when a browser sends one, must be this server's own origin — the request's scheme, the
  host and the port of its `Host` (default ports normalised) — or one of `allowed_origins`; a name in
  `allowed_hosts` is also allowed as an origin on its scheme's default port (a proxy in front). A page
  on another site, or on another port of the same host (another local web app), cannot drive the REST
  API or open `/aip` from a victim's browser. `Origin: null` is refused.
- **Bodies** are capped before anything parses them: a declared `Content-Length` over the cap is
  answered 413 without reading a byte of the body, and a streamed body is counted chunk by chunk
  and cut off at the cap. The cap is `ANONYMOUS_BODY_BYTES` (64 KiB) unless the request carries a
  valid API token, then `max_body_bytes`; the token is only looked up for a body larger than the
  small cap, so the common small request pays nothing here.

**Throttles** (ratelimit.py, one per app, read off `scope["app"].throttles`): a request carrying
credentials (`Authorization`, a dashboard login) from an address with too many failed
checks is answered 429 with `Retry-After` before anything checks it, and each 401 answered to such a
request is counted; a pairing claim spends a claim of its address and its code, 429 when either has
none left.

The hot routes (the command POSTs and `/aip`), which `front.ServerApp` answers ahead of FastAPI's
stack, go through an instance of the same class with the same settings: no route is unguarded.

Refusals are `{"error": "…"}` like every other error of the server; a refused WebSocket handshake
gets the same JSON as an HTTP denial response where the ASGI server supports it (uvicorn does),
else a plain 403.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from tether.errors import ServerError
from tether.server.http.logsafe import clean, mark_denied_handshake
from tether.server.http.ratelimit import Throttled, Throttles
from tether.server.settings import (
    ANONYMOUS_BODY_BYTES,
    DEFAULT_PORTS,
    Origin,
    ServerSettings,
    is_ip,
    normalize_host,
    parse_origin,
)

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[..., Any]

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
_VERDICTS_KEPT = 256
WILDCARDS = ("0.0.0.0", "::", "")  # noqa: S104 (names of the wildcard binds, not a bind)


class HostRules:
    """Which host names a request may use in `Host` and `Origin`."""

    def __init__(self, bind_host: str, extra: Iterable[str] = (), origins: Iterable[str] = ()) -> None:
        self.any = False
        self.names: set[str] = set(LOCAL_NAMES)
        # (Host, Origin, scheme) -> the verdict: a server sees few distinct ones, and working one out
        # (normalising the name, scanning its characters) was ~3% of the server's CPU per REST command
        self._verdicts: dict[tuple[bytes | None, bytes | None, str], str | None] = {}
        self.suffixes: list[str] = []
        self.listed: set[str] = set()  # names the operator listed: origins on their default ports too
        self.listed_suffixes: list[str] = []
        self.origins: set[Origin] = {o for o in map(parse_origin, origins) if o is not None}
        bind = bind_host.strip().strip("[]").lower()
        # Bound to every interface, the server is reached by addresses and names it cannot list
        # here. An IP literal cannot be re-pointed by DNS, so any address is accepted then; names
        # still have to be allowed (the machine's own host name is).
        self.any_ip = bind in WILDCARDS
        if self.any_ip:
            self.names.add(socket.gethostname().lower())
        elif bind:
            self.names.add(bind)
        for entry in extra:
            entry = entry.strip().lower()
            if entry == "*":
                self.any = True
            elif entry.startswith("*."):
                self.suffixes.append(entry[1:].rstrip("."))
                self.listed_suffixes.append(entry[1:].rstrip("."))
            elif (host := normalize_host(entry)) is not None:
                self.names.add(host)
                self.listed.add(host)

    def allows(self, host: str | None) -> bool:
        if self.any:
            return True
        if host is None:
            return False
        if host in self.names or any(host.endswith(s) for s in self.suffixes):
            return True
        return self.any_ip and is_ip(host)

    def check(self, headers: dict[bytes, bytes], raw: Iterable[tuple[bytes, bytes]] = (),
              scheme: str = "http") -> str | None:
        """Why these request headers are refused, or None. `raw` (all header pairs) is looked at for
        repeated Host or Origin headers, which are refused: parts of a stack may read different ones.
        `scheme` is the request's (the ASGI scope's: http, https, ws or wss)."""
        if self.any:
            return None
        if not isinstance(raw, (list, tuple)) or len(raw) > len(headers):  # some header repeats: which?
            names = [name for name, _ in raw if name in (b"host", b"origin")]
            if names.count(b"host") > 1 or names.count(b"origin") > 1:
                return "refused: the request repeats its Host or Origin header"
        key = (headers.get(b"host"), headers.get(b"origin"), scheme)
        try:
            return self._verdicts[key]
        except KeyError:
            pass
        verdict = self._verdict(*key)
        if len(self._verdicts) >= _VERDICTS_KEPT:  # names an attacker makes up cannot grow it
            self._verdicts.clear()
        self._verdicts[key] = verdict
        return verdict

    def _verdict(self, raw_host: bytes | None, origin: bytes | None, scheme: str) -> str | None:
        if raw_host is None:
            return "refused: the request has no Host header"
        host = normalize_host(raw_host.decode("latin-1"))
        if not self.allows(host):
            return (f"refused: Host {clean(raw_host.decode('latin-1'))!r} is not an allowed name for this "
                    "server (DNS rebinding?); an operator can allow it with 'tether server --allowed-host NAME' "
                    "or the server setting allowed_hosts")
        if origin is not None:
            text = origin.decode("latin-1").strip()
            if not self.origin_allowed(parse_origin(text), raw_host.decode("latin-1"), scheme):
                return (f"refused: cross-site request from Origin {clean(text)!r}; only pages of this server's "
                        "own origin (scheme, host and port) may call it; an operator can allow another with "
                        "the server setting allowed_origins")
        return None

    def origin_allowed(self, origin: Origin | None, raw_host: str, scheme: str) -> bool:
        """Whether a page of `origin` may call this server through a request with this `Host` and `scheme`:
        the same origin, or one the operator allowed (see the module docstring)."""
        if origin is None:
            return False
        if origin in self.origins:
            return True
        own_scheme = "https" if scheme in ("https", "wss") else "http"
        host = normalize_host(raw_host)
        port = _host_port(raw_host)
        same_host = origin[1] == host or (origin[1] in LOCAL_NAMES and host in LOCAL_NAMES)  # one machine
        if same_host and origin[0] == own_scheme and origin[2] == (DEFAULT_PORTS[own_scheme] if port is None else port):
            return True
        name = origin[1]
        listed = name in self.listed or any(name.endswith(s) for s in self.listed_suffixes)
        return listed and origin[2] == DEFAULT_PORTS[origin[0]]

    async def refused(self, scope: Scope, send: Callable[[Message], Any],
                      headers: dict[bytes, bytes] | None = None) -> bool:
        """True when these rules refuse the request, answered (403 `{"error": …}`) and logged. For the AIP
        WebSocket this is the whole guard: front.py then runs the socket with no guard frame around it
        for the socket's life."""
        raw = scope.get("headers") or ()
        headers = dict(raw) if headers is None else headers
        refusal = self.check(headers, raw, scope.get("scheme", "http"))
        if refusal is None:
            return False
        await self.refuse(scope, send, refusal, headers)
        return True

    async def refuse(self, scope: Scope, send: Callable[[Message], Any], refusal: str,
                     headers: dict[bytes, bytes], receive: Callable[[], Any] | None = None) -> None:
        """Answer (and log) a request `check` refused."""
        kind = scope["type"]
        client = scope.get("client")
        logger.warning("refused %s %s from %s: %s", "WebSocket" if kind == "websocket" else scope.get("method"),
                       scope.get("path"), f"{client[0]}:{client[1]}" if client else None, refusal)
        if kind == "websocket":
            await deny_websocket(scope, send, 403, refusal)
        else:
            await send_error(send, 403, refusal, receive=receive, headers=headers)


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


LOGIN_SUFFIX = "/web/login"
_CLAIM = re.compile(r"/api/v1/pairing/([^/]{1,64})/claim/?$")


def client_address(scope: Scope) -> str:
    """The client's address as the ASGI server reports it ('' when it reports none)."""
    client = scope.get("client")
    return str(client[0]) if client else ""


def presents_credentials(scope: Scope, headers: dict[bytes, bytes]) -> bool:
    """Whether the request carries something a failed check of which counts: an `Authorization` header or
    a dashboard login. (Not a cookie: a dashboard session id is not guessable, and a browser holding a
    stale one would throttle its own next login.)"""
    return b"authorization" in headers or (scope.get("method") == "POST" and scope["path"].endswith(LOGIN_SUFFIX))


def throttled_by(throttles: Throttles, scope: Scope, headers: dict[bytes, bytes]) -> Throttled | None:
    """The throttle that refuses this request now, if any (a pairing claim spends one here)."""
    address = client_address(scope)
    if scope["type"] == "http" and scope.get("method") == "POST" and "/pairing/" in scope["path"]:
        claim = _CLAIM.search(scope["path"])
        if claim is not None and (refused := throttles.claim(address, claim.group(1))) is not None:
            return refused
    if presents_credentials(scope, headers):
        return throttles.credentials_blocked(address)
    return None


def counting_failures(send: Callable[[Message], Any], throttles: Throttles, address: str) -> Callable[[Message], Any]:
    """`send`, counting a 401 answer as a failed credential check of `address`. A plain function that
    returns `send`'s awaitable: no coroutine frame per message."""

    def counted(message: Message) -> Any:
        if message["type"] == "http.response.start" and message["status"] == 401:
            throttles.credentials_failed(address)
        return send(message)

    return counted


async def answer_throttled(scope: Scope, receive: Callable[[], Any], send: Callable[[Message], Any],
                           headers: dict[bytes, bytes], throttled: Throttled) -> None:
    """The 429 `{"error": …}` with `Retry-After` (a WebSocket handshake: as its denial response)."""
    logger.warning("throttled %s %s from %s: %s", "WebSocket" if scope["type"] == "websocket" else scope.get("method"),
                   scope.get("path"), client_address(scope), throttled.error)
    extra = [(b"retry-after", throttled.retry_after.encode())]
    if scope["type"] == "websocket":
        await deny_websocket(scope, send, 429, throttled.error, extra)
    else:
        await send_error(send, 429, throttled.error, receive=receive, headers=headers, extra=extra)


async def throttled_handshake(scope: Scope, send: Callable[[Message], Any], headers: dict[bytes, bytes]) -> bool:
    """For the AIP socket, which front.py runs without the guard around it: True when a throttle refused
    the handshake (answered 429)."""
    throttles: Throttles | None = getattr(scope.get("app"), "throttles", None)
    if throttles is None:
        return False
    throttled = throttled_by(throttles, scope, headers)
    if throttled is None:
        return False
    await answer_throttled(scope, _no_body, send, headers, throttled)
    return True


async def _no_body() -> Message:
    return {"type": "websocket.disconnect", "code": 1000}


class BodyTooLarge(ServerError):
    """Raised into the app from `receive` when a streamed body passes the cap."""


def _host_port(raw_host: str) -> int | None:
    """The port a `Host` value names, or None when it names none."""
    value = raw_host.strip()
    tail = value[value.find("]") + 1:] if value.startswith("[") else value
    if tail.count(":") != 1:
        return None
    port = tail.rpartition(":")[2]
    return int(port) if port.isdigit() else None


def _size(n: int) -> str:
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)} MiB"
    if n % 1024 == 0:
        return f"{n // 1024} KiB"
    return f"{n} bytes"


async def send_error(send: Callable[[Message], Any], status: int, error: str, *,
                     receive: Callable[[], Any] | None = None, headers: dict[bytes, bytes] | None = None,
                     extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """A complete `{"error": …}` response.

    Given the request's `receive` and `headers`, a small body (see `drain`) is read and dropped first and
    the connection stays open. Otherwise the connection is closed after the answer: the body was not
    read, so the connection cannot carry another request — and the client may lose the answer to the
    TCP reset that closing a socket with unread bytes sends, a cost only a body too large to read pays.
    """
    kept = receive is not None and headers is not None and await drain(receive, headers)
    body = json.dumps({"error": error}).encode()
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    if not kept:
        start.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


DRAIN_TIMEOUT = 5.0


async def drain(receive: Callable[[], Any], headers: dict[bytes, bytes]) -> bool:
    """Read and drop a request body of at most `ANONYMOUS_BODY_BYTES` declared in Content-Length (or no
    body at all); True when it ended within `DRAIN_TIMEOUT`. A larger or chunked body is not read
    (False): a refused request does not get to make the server read megabytes."""
    declared = headers.get(b"content-length")
    if declared is None:
        if b"transfer-encoding" in headers:
            return False
    else:
        text = declared.decode("latin-1").strip()
        if not text.isdigit() or int(text) > ANONYMOUS_BODY_BYTES:
            return False
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT):
            return await receive_body(receive) is not None
    except TimeoutError:
        return False


async def receive_body(receive: Callable[[], Any]) -> bytes | None:
    """The whole request body off ASGI `receive`, or None when the client left first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def deny_websocket(scope: Scope, send: Callable[[Message], Any], status: int, error: str,
                         headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Refuse a WebSocket handshake: an HTTP answer with `{"error": …}` (and `headers`, e.g. Retry-After)
    where the server supports denial responses, else the plain 403 a close before accept becomes.
    A 401 to a handshake that carried credentials counts as a failed check (`Throttles`)."""
    mark_denied_handshake()
    if status == 401:
        throttles: Throttles | None = getattr(scope.get("app"), "throttles", None)
        if throttles is not None and presents_credentials(scope, dict(scope.get("headers") or ())):
            throttles.credentials_failed(client_address(scope))
    if "websocket.http.response" in (scope.get("extensions") or {}):
        body = json.dumps({"error": error}).encode()
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *(headers or [])]})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": ""})
