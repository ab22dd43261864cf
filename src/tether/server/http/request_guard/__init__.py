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

from tether.server.http.request_guard.answers import DRAIN_TIMEOUT, deny_websocket, drain, receive_body, send_error
from tether.server.http.request_guard.guard import BodyTooLarge, RequestGuard, TokenCheck
from tether.server.http.request_guard.hosts import LOCAL_NAMES, WILDCARDS, HostRules
from tether.server.http.request_guard.requests import (
    LOGIN_SUFFIX,
    ASGIApp,
    Message,
    Scope,
    client_address,
    presents_credentials,
)
from tether.server.http.request_guard.throttling import (
    answer_throttled,
    counting_failures,
    throttled_by,
    throttled_handshake,
)

__all__ = [
    "DRAIN_TIMEOUT", "LOCAL_NAMES", "LOGIN_SUFFIX", "WILDCARDS", "ASGIApp", "BodyTooLarge", "HostRules", "Message",
    "RequestGuard", "Scope", "TokenCheck", "answer_throttled", "client_address", "counting_failures",
    "deny_websocket", "drain", "presents_credentials", "receive_body", "send_error", "throttled_by",
    "throttled_handshake",
]
