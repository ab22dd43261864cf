"""Every use of Starlette's and uvicorn's private code, in one module.

The server's hot path and its transport edge reach below the frameworks' public APIs: uvicorn's HTTP
protocol classes (their parser callbacks, the request cycle, the keep-alive timer), its `Server`'s
start-up message and tick, its logging set-up and the words of its log lines; Starlette's cached
request body and a WebSocket's raw `send`. Nothing else in tether touches them: the other modules ask
this one. It was written for the versions in `WRITTEN_FOR`, which pyproject.toml pins as bounds, and
tests/server/http/test_internals.py checks the installed versions and that every name in
`PRIVATE_NAMES` is still there, so an upgrade fails in that test and not in production.

Framework modules are imported inside the functions that need them: the CLI imports
`tether.server.http.logsafe` (and through it this module) without paying for a web framework.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio
    import socket

    import uvicorn
    from starlette.requests import Request
    from starlette.websockets import WebSocket

    from tether.server.http.edge import ConnectionCaps
    from tether.server.settings import ServerSettings

# (lowest, first not supported) for each framework whose private code this module uses; pyproject.toml pins
# the same range
WRITTEN_FOR: dict[str, tuple[str, str]] = {"starlette": ("1.10", "1.11"), "uvicorn": ("0.54", "0.55")}

# "module:Class" -> the private (or undocumented) names this module relies on, for the test that an upgrade
# kept them; instance attributes are checked on an instance the test makes
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "uvicorn.protocols.http.httptools_impl:HttpToolsProtocol": (
        "connection_made", "connection_lost", "data_received", "eof_received", "on_message_begin",
        "on_headers_complete", "on_message_complete", "handle_websocket_upgrade", "timeout_keep_alive_handler",
        "send_400_response"),
    "uvicorn.protocols.http.h11_impl:H11Protocol": (
        "connection_made", "connection_lost", "data_received", "eof_received", "handle_websocket_upgrade",
        "timeout_keep_alive_handler", "send_400_response"),
    "uvicorn.protocols.websockets.auto:AutoWebSocketsProtocol": ("connection_made", "connection_lost"),
    "uvicorn.server:Server": ("startup", "shutdown", "on_tick", "_log_started_message"),
    "uvicorn.config:LOGGING_CONFIG": (),
    "uvicorn.logging:DefaultFormatter": (),
}
# set on every Starlette `WebSocket` (`_send`, the ASGI server's send) and read by `Request.body()` (`_body`)
STARLETTE_ATTRIBUTES = ("WebSocket._send", "Request._body")
# set on every uvicorn HTTP protocol instance as it is made (checked on one by the test)
PROTOCOL_ATTRIBUTES = ("loop", "transport", "scope", "cycle", "timeout_keep_alive_task")
# set on uvicorn's request cycle (`protocol.cycle`) as it is made
CYCLE_ATTRIBUTES = ("response_started", "keep_alive")

# uvicorn's log records, as its code writes them
ACCESS_LOGGER = "uvicorn.access"
ACCESS_LINE = '%s - "%s %s HTTP/%s" %d'  # its access lines: (client, method, path?query, http version, status)
ERROR_LOGGER = "uvicorn.error"
WEBSOCKET_LINE = '%s - "WebSocket %s"'  # the start of its WebSocket handshake lines: (client, path+query, …)
# logged at ERROR by uvicorn's websockets-sansio implementation after every handshake refused with a denial
# response, although the refusal went out as intended (Kludex/uvicorn PR #3138)
SPURIOUS_HANDSHAKE_ERROR = "ASGI callable returned without completing handshake."
DEFAULT_FORMATTER = "uvicorn.logging.DefaultFormatter"  # formats `%(levelprefix)s` as uvicorn's own lines


def uvicorn_logging_config() -> dict[str, Any]:
    """A deep copy of uvicorn's default `logging.config.dictConfig` set-up (its formatters, handlers, loggers)."""
    from uvicorn.config import LOGGING_CONFIG

    return copy.deepcopy(LOGGING_CONFIG)


# -- Starlette --------------------------------------------------------------------------------------------

def keep_body(request: Request, body: bytes) -> None:
    """Store `body`, read off `receive` by the caller, where `Request.body()` and `Request.json()` find it."""
    request._body = body


def enter_app(scope: MutableMapping[str, Any], app: object) -> None:
    """Put `app` where Starlette's `Request.app` reads it (`scope["app"]`, which Starlette's own app sets as a
    request enters it): for a request answered without entering the Starlette app's `__call__`."""
    scope["app"] = app


def set_path_params(scope: MutableMapping[str, Any], params: dict[str, str]) -> None:
    """Put a route's path parameters where Starlette's `Request.path_params` reads them (`scope["path_params"]`,
    which Starlette's router sets when a route matches): for a route matched outside that router."""
    scope["path_params"] = params


async def websocket_send_raw(websocket: WebSocket, message: dict[str, Any]) -> None:
    """Send one ASGI message on an accepted WebSocket straight to the server's `send`, past Starlette's state
    checks and coroutines. Raises what the ASGI server raises (uvicorn: an `OSError` once the peer is gone,
    a `RuntimeError` after the close)."""
    await websocket._send(message)


# -- uvicorn: the HTTP and WebSocket protocols --------------------------------------------------------------

def http_protocol_base() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class as `http="auto"` picks it: httptools' when installed, else h11's."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # httptools not installed: the pure-Python parser
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base  # type: ignore[assignment]
    return Base


def websocket_protocol_base() -> type[asyncio.Protocol]:
    """uvicorn's WebSocket protocol class as `ws="auto"` picks it; `RuntimeError` when it has none."""
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    if AutoWebSocketsProtocol is None:
        raise RuntimeError("uvicorn has no WebSocket implementation: pip install websockets")
    return AutoWebSocketsProtocol  # type: ignore[return-value]


def give_websocket_real_transport(protocol: asyncio.BaseProtocol, wrapper: object,
                                  transport: asyncio.BaseTransport) -> None:
    """After a WebSocket upgrade: where uvicorn's WebSocket `protocol` holds `wrapper` as its transport, give it
    the real `transport` instead."""
    if getattr(protocol, "transport", None) is wrapper:  # uvicorn's WebSocket protocols keep it as `.transport`
        protocol.transport = transport  # type: ignore[attr-defined]


def coalescing_http_protocol(watch_key: str, wrap: Callable[[asyncio.Transport], object]
                             ) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (`http_protocol_base`) with its transport replaced by `wrap(transport)` as
    the connection is made, and `scope[watch_key]` set to `watch(callback) -> unwatch` on every request:
    `callback` runs once when the connection is lost (on the next loop turn if it already is)."""
    base = http_protocol_base()

    class CoalescingHTTPProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:
            self._watchers: set[Callable[[], None]] = set()
            self._lost = False
            super().connection_made(wrap(transport))

        def on_headers_complete(self) -> None:
            self.scope[watch_key] = self._watch  # in the scope before the request's cycle is built on it
            super().on_headers_complete()

        def _watch(self, callback: Callable[[], None]) -> Callable[[], None]:
            if self._lost:
                handle = self.loop.call_soon(callback)
                return handle.cancel
            self._watchers.add(callback)
            return lambda: self._watchers.discard(callback)

        def connection_lost(self, exc: Exception | None) -> None:
            self._lost = True
            try:
                super().connection_lost(exc)
            finally:
                watchers, self._watchers = self._watchers, set()
                for callback in watchers:
                    callback()

    return CoalescingHTTPProtocol


def edge_http_protocol(base: type[asyncio.Protocol], caps: ConnectionCaps, settings: ServerSettings
                       ) -> type[asyncio.Protocol]:
    """`base` (uvicorn's HTTP protocol, possibly already wrapped) with the caps and timeouts of `edge`'s module
    docstring. uvicorn's `timeout_keep_alive` must be `settings.idle_timeout` (build_config sets it)."""
    from tether.server.http.edge import SOCKET_RETRY_AFTER, peer_address, raw_error

    header_timeout = settings.header_timeout
    body_timeout = settings.body_timeout
    idle_timeout = settings.idle_timeout

    class EdgeHTTPProtocol(base):  # type: ignore[misc, valid-type]
        _edge_address: str | None = None  # set while the connection counts against its address's cap
        _edge_refused = False
        _edge_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            address = peer_address(transport)
            if not caps.admit_http(address):
                self._edge_refused = True
                transport.abort()  # nothing read, nothing answered: the descriptor is freed at once
                return
            self._edge_address = address
            super().connection_made(transport)
            # a connection that never starts a request is closed as an idle keep-alive one is
            self.timeout_keep_alive_task = self.loop.call_later(idle_timeout, self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            if not self._edge_refused:
                super().data_received(data)

        def eof_received(self) -> Any:
            return None if self._edge_refused else super().eof_received()

        def _edge_arm(self, seconds: float, what: str) -> None:
            self._edge_disarm()
            self._edge_timer = self.loop.call_later(seconds, self._edge_expired, what)

        def _edge_disarm(self) -> None:
            if self._edge_timer is not None:
                self._edge_timer.cancel()
                self._edge_timer = None

        def _edge_expired(self, what: str) -> None:
            self._edge_timer = None
            if self.transport.is_closing():
                return
            cycle = getattr(self, "cycle", None)
            answered = cycle is not None and getattr(cycle, "response_started", False) and what == "body"
            if not answered:
                limit = header_timeout if what == "headers" else body_timeout
                setting = "header_timeout" if what == "headers" else "body_timeout"
                self.transport.write(raw_error(408, f"the request's {what} took longer than {limit:g} s "
                                                    f"(server setting {setting})"))
            if cycle is not None and what == "body":
                cycle.keep_alive = False
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            # bytes uvicorn's parser refused (a control character in a header, not HTTP at all): `{"error": …}`
            # as every other HTTP error of the server (uvicorn's own answer is text/plain), and the connection closed
            self.transport.write(raw_error(400, f"{msg} (not an HTTP/1.1 request this server can read)"))
            self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._edge_arm(header_timeout, "headers")

        def on_headers_complete(self) -> None:
            self._edge_arm(body_timeout, "body")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._edge_disarm()
            super().on_message_complete()

        def handle_websocket_upgrade(self, *args: Any) -> None:  # h11's takes the event, httptools' nothing
            self._edge_disarm()
            address = self._edge_address
            if address is not None:
                caps.release_http(address)
                self._edge_address = None
                if not caps.admit_socket(address):
                    self.transport.write(raw_error(
                        503, "too many WebSockets from this address (server settings max_sockets_per_address, "
                             "max_sockets_per_loopback); try again later",
                        ((b"retry-after", str(SOCKET_RETRY_AFTER).encode()),)))
                    self.transport.close()
                    return
            super().handle_websocket_upgrade(*args)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._edge_refused:
                return
            self._edge_disarm()
            if self._edge_address is not None:
                caps.release_http(self._edge_address)
                self._edge_address = None
            super().connection_lost(exc)

    return EdgeHTTPProtocol


def edge_ws_protocol(base: type[asyncio.Protocol], caps: ConnectionCaps) -> type[asyncio.Protocol]:
    """`base` (uvicorn's WebSocket protocol) giving its address's socket place back when it closes. Every
    instance is made by `EdgeHTTPProtocol.handle_websocket_upgrade`, after `admit_socket`."""
    from tether.server.http.edge import peer_address

    class EdgeWSProtocol(base):  # type: ignore[misc, valid-type]
        _edge_address: str | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self._edge_address = peer_address(transport)
            super().connection_made(transport)

        def connection_lost(self, exc: Exception | None) -> None:
            try:
                super().connection_lost(exc)
            finally:
                if self._edge_address is not None:
                    caps.release_socket(self._edge_address)
                    self._edge_address = None

    return EdgeWSProtocol


def edge_protocols(settings: ServerSettings, http: type[asyncio.Protocol],
                   ) -> tuple[type[asyncio.Protocol], type[asyncio.Protocol], ConnectionCaps]:
    """The HTTP and WebSocket protocol classes for uvicorn's `http=` and `ws=` (`http` wrapped by
    `edge_http_protocol`, uvicorn's WebSocket protocol by `edge_ws_protocol`), sharing one new `ConnectionCaps`.
    `RuntimeError` when uvicorn has no WebSocket implementation."""
    from tether.server.http.edge import ConnectionCaps

    ws_base = websocket_protocol_base()
    caps = ConnectionCaps(settings)
    return edge_http_protocol(http, caps, settings), edge_ws_protocol(ws_base, caps), caps


# -- uvicorn: the server ------------------------------------------------------------------------------------

def hooked_server(config: uvicorn.Config, on_stopping: Callable[[], None],
                  on_tick: Callable[[int], None]) -> uvicorn.Server:
    """A uvicorn `Server` for `config` that calls `on_stopping()` as its shutdown begins, `on_tick(counter)` on
    each of its ticks (every 0.1 s) before its own, and logs where it listens for sockets it was given as
    well as for those it bound."""
    import uvicorn

    class HookedServer(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            on_stopping()
            await super().shutdown(sockets)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if sockets is not None and not self.should_exit:  # uvicorn says where it listens only for its own
                self._log_started_message(sockets)

        async def on_tick(self, counter: int) -> bool:
            on_tick(counter)
            return await super().on_tick(counter)

    return HookedServer(config)
