"""Run the agent server with uvicorn: loopback by default, TLS when given, tokens always."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from tether.server.app import create_app
from tether.server.coalesce import coalescing_http_protocol
from tether.server.edge import edge_protocols
from tether.server.logsafe import server_log_config
from tether.server.settings import ServerSettings, is_loopback
from tether.server.store import Store

logger = logging.getLogger(__name__)


class UnsafeBinding(ValueError):
    """Refused to listen off loopback without what keeps the server safe there."""


def check_binding(settings: ServerSettings, store: Store, *, allow_insecure: bool = False) -> None:
    """Off loopback the server needs tokens (so someone can authenticate) and TLS (so the tokens
    do not cross the network in clear text) unless the operator says otherwise explicitly."""
    if is_loopback(settings.host):
        return
    active = [t for t in store.list_tokens() if t.revoked_at is None]
    if not active:
        raise UnsafeBinding(f"refusing to listen on {settings.host}: no tokens exist, so nobody could "
                            "authenticate; create them first with 'tether token create --device NAME' "
                            "and 'tether token create --api'")
    if not (settings.tls_cert and settings.tls_key) and not allow_insecure:
        raise UnsafeBinding(f"refusing to listen on {settings.host} without TLS: tokens would travel in "
                            "clear text; pass --tls-cert and --tls-key (or --allow-insecure on a trusted "
                            "network)")


AppFactory = Callable[[ServerSettings, Store], FastAPI]


def build_config(settings: ServerSettings, *, allow_insecure: bool = False, log_level: str = "info",
                 app_factory: AppFactory = create_app) -> uvicorn.Config:
    """`app_factory` builds the app (the agent layer passes one that adds tasks).

    Logging: uvicorn's handlers plus the server's own loggers, every line escaped and the access
    log without query strings (`tether.server.logsafe`)."""
    store = Store(settings.db_target)
    store.check_writable()  # a full or read-only state directory: StoreUnavailable, one line
    check_binding(settings, store, allow_insecure=allow_insecure)
    app = app_factory(settings, store)
    # connection caps per client address and the header/body/idle timeouts, at the transport (edge.py)
    http, ws, _ = edge_protocols(settings, coalescing_http_protocol())  # one write per response sent whole
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                          backlog=settings.listen_backlog,
                          log_config=server_log_config(log_level),
                          # headroom above the AIP limit so the hub, not the transport, answers an
                          # oversized frame with an ERROR that says what the limit is
                          ws_max_size=settings.max_frame_bytes * 2, ws_per_message_deflate=False,
                          ws_ping_interval=None,
                          ssl_certfile=settings.tls_cert, ssl_keyfile=settings.tls_key,
                          lifespan="on", timeout_graceful_shutdown=5,
                          # no access log where its level would drop every line: uvicorn formats each
                          # request's line whenever the logger has a handler (~1% of the CPU per command)
                          access_log=log_level.lower() in ("trace", "debug", "info"),
                          server_header=False,  # no "server: uvicorn" on every answer: a fingerprint, and bytes
                          timeout_keep_alive=settings.idle_timeout,  # type: ignore[arg-type]
                          http=http, ws=ws)


class _Server(uvicorn.Server):
    """Calls the app's `state.on_stopping` hooks as the shutdown begins: long-lived responses (a task's
    event stream) end then, instead of being cancelled with a traceback once the grace period is over."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for hook in getattr(getattr(self.config.app, "state", None), "on_stopping", []):
            try:
                hook()
            except Exception:
                logger.exception("a shutdown hook failed; stopping anyway")
        await super().shutdown(sockets)


def run_server(settings: ServerSettings, *, allow_insecure: bool = False, log_level: str = "info",
               app_factory: AppFactory = create_app) -> None:
    _Server(build_config(settings, allow_insecure=allow_insecure, log_level=log_level,
                                app_factory=app_factory)).run()
