"""Run the agent server with uvicorn: loopback by default, TLS when given, tokens always."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import socket
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from tether.errors import ConfigError, ServerError
from tether.server.http.app import create_app
from tether.server.http.coalesce import coalescing_http_protocol
from tether.server.http.internals import ACCESS_LOGGER, edge_protocols, hooked_server
from tether.server.http.logsafe import server_log_config, skip_caller_lookup
from tether.server.settings import ServerSettings, is_loopback
from tether.server.store import Store
from tether.server.store.lease import StateLease, take_lease

logger = logging.getLogger(__name__)
LEASE_CHECK_TICKS = 20  # uvicorn ticks (0.1 s): how often the server checks that it still holds its lease


class UnsafeBinding(ServerError, ConfigError, ValueError):
    """Refused to listen off loopback without what keeps the server safe there."""


def check_binding(settings: ServerSettings, store: Store, *, allow_insecure: bool = False) -> None:
    """Off loopback the server needs tokens (so someone can authenticate) and TLS (so the tokens
    do not cross the network in clear text) unless the operator says otherwise explicitly."""
    if is_loopback(settings.host):
        return
    active = [t for t in store.tokens.all() if t.revoked_at is None]
    if not active:
        raise UnsafeBinding(f"refusing to listen on {settings.host}: no tokens exist, so nobody could "
                            "authenticate; create them first with 'tether token create --device NAME' "
                            "and 'tether token create --api'")
    if not (settings.tls_cert and settings.tls_key) and not allow_insecure:
        raise UnsafeBinding(f"refusing to listen on {settings.host} without TLS: tokens would travel in "
                            "clear text; pass --tls-cert and --tls-key (or --allow-insecure on a trusted "
                            "network)")


AppFactory = Callable[[ServerSettings, Store], FastAPI]


class PortInUse(ServerError, OSError):
    """The address the server was told to listen on cannot be bound (in use, not this machine's, no right)."""


class StateClaim:
    """What a starting server holds before it touches a row or recovers anything: the lease on its state
    (`tether.server.store.lease`: its node on its database) and its listening sockets, already bound.

    Start-up runs in this order, so a second server started by mistake is refused before it changes
    anything: lease → bind → open and migrate the database → settle what a server alone on it finds
    left in flight → build the app → (uvicorn's lifespan) resume tasks → serve."""

    def __init__(self, lease: StateLease, sockets: list[socket.socket]) -> None:
        self.lease = lease
        self.sockets = sockets

    def recover(self, store: Store) -> None:
        """Settle what the last server left in flight, if this server is alone on the database (else those
        rows are another live server's), then let other servers join the database."""
        if self.lease.alone:
            settled = store.audit.settle_sent()
            if settled:
                logger.warning("%d command(s) were in flight when the last server stopped: their audit rows say "
                               "'unknown'", settled)
        self.lease.settled()

    def release(self) -> None:
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()
        self.lease.release()


def claim_state(settings: ServerSettings) -> StateClaim:
    """Lease the state, then bind the port: `StateBusy` (a `StoreUnavailable`) when another live server holds
    this node on this database, `PortInUse` when the address cannot be bound; either in one line, with
    nothing written."""
    lease = take_lease(settings.db_target, settings.node, host=settings.host, port=settings.port,
                       default_node=settings.node_id is None)
    try:
        sockets = bind_sockets(settings.host, settings.port, settings.listen_backlog)
    except BaseException:
        lease.release()
        raise
    lease.announce(settings.host, sockets[0].getsockname()[1])
    return StateClaim(lease, sockets)


def bind_sockets(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets for every address of `host` (as asyncio's `create_server` binds them), listening
    at once: a bound socket that does not listen yet would not keep a second server off the port."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortInUse(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # every address on the port the first one was given
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(backlog)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        reason = "the port is in use (another server?)" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        raise PortInUse(f"cannot listen on {host}:{port}: {reason}") from None
    return sockets


def build_config(settings: ServerSettings, *, allow_insecure: bool = False, log_level: str = "info",
                 app_factory: AppFactory = create_app, claim: StateClaim | None = None) -> uvicorn.Config:
    """`app_factory` builds the app (the agent layer passes one that adds tasks). `claim`: the state and
    sockets `claim_state` took (then what the last server left in flight is settled here, before the app).

    Logging: uvicorn's handlers plus the server's own loggers, every line escaped and the access
    log without query strings (`tether.server.http.logsafe`)."""
    store = Store(settings.db_target)
    store.check_writable()  # a full or read-only state directory: StoreUnavailable, one line
    if claim is not None:
        claim.recover(store)
    check_binding(settings, store, allow_insecure=allow_insecure)
    app = app_factory(settings, store)
    # connection caps per client address and the header/body/idle timeouts, at the transport (edge.py)
    http, ws, _ = edge_protocols(settings, coalescing_http_protocol())  # one write per response sent whole
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
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
    skip_caller_lookup(logging.getLogger(ACCESS_LOGGER))  # an access line per request at info
    return config


def stopping_hooks(app: object) -> Callable[[], None]:
    """What runs as the shutdown begins: the app's `state.on_stopping` hooks, each in turn (one that fails is
    logged and the others still run). Long-lived responses (a task's event stream) end then, instead of being
    cancelled with a traceback once the grace period is over."""

    def run() -> None:
        for hook in getattr(getattr(app, "state", None), "on_stopping", []):
            try:
                hook()
            except Exception:
                logger.exception("a shutdown hook failed; stopping anyway")

    return run


class LeaseWatch:
    """Checks the state's lease every `LEASE_CHECK_TICKS` of uvicorn's ticks (0.1 s each): a lease lost
    (PostgreSQL: its session ended) is taken again off the loop, and an error logged for as long as it cannot
    be (another server took the node meanwhile). With no lease, `tick` does nothing."""

    def __init__(self, lease: StateLease | None) -> None:
        self.lease = lease
        self._retaking: asyncio.Future[str | None] | None = None

    def tick(self, counter: int) -> None:
        if self.lease is not None and counter % LEASE_CHECK_TICKS == 0 and self._retaking is None \
                and self.lease.lost():
            self._retaking = asyncio.get_running_loop().run_in_executor(None, self.lease.retake)
            self._retaking.add_done_callback(self._retaken)

    def _retaken(self, done: asyncio.Future[str | None]) -> None:
        self._retaking = None
        problem = done.exception() or done.result()
        if problem:
            logger.error("this server's lease on its state was lost and cannot be taken again: %s", problem)
        else:
            logger.warning("this server's lease on its state was lost (the database's session ended) and is "
                           "held again")


def freeze_once_started(tick: Callable[[int], None]) -> Callable[[int], None]:
    """`tick` that also, at the first of uvicorn's ticks (the app's start-up done: the modules, routes, schemas
    and the hub), moves every object alive then into the collector's permanent generation (`gc.freeze`): the
    full collections a stream of commands triggers then walk only what came after. For a process that is the
    server (`make_server`): the freeze is the whole process's. The hub's `GcKeeper` may thaw it (a shrinking
    large fleet) and freezes again itself."""
    frozen = False

    def first_freezes(counter: int) -> None:
        nonlocal frozen
        if not frozen:
            frozen = True
            gc.freeze()
        tick(counter)

    return first_freezes


def make_server(config: uvicorn.Config, lease: StateLease | None = None) -> uvicorn.Server:
    """A uvicorn `Server` for `config` (from `build_config`) that runs the app's `state.on_stopping` hooks as
    its shutdown begins (`stopping_hooks`), freezes its start-up objects out of the collector's full scans
    once started (`freeze_once_started`) and, given the state's `lease`, watches it (`LeaseWatch`)."""
    return hooked_server(config, stopping_hooks(config.app), freeze_once_started(LeaseWatch(lease).tick))


def run_server(settings: ServerSettings, *, allow_insecure: bool = False, log_level: str = "info",
               app_factory: AppFactory = create_app, claim: StateClaim | None = None) -> None:
    """Serve the agent server with uvicorn until it is stopped (SIGINT/SIGTERM); `tether server` calls this.

    `settings`: where to listen, the database, TLS, limits. `app_factory(settings, store)` builds the app
    (`create_app` by default: AIP and REST; `tether.agent.server_app.create_agent_app` adds the task API).
    `allow_insecure`: serve plain HTTP off loopback. `log_level`: uvicorn's. `claim`: what `claim_state` took
    (taken here when not given); released at the end.

    Raises `UnsafeBinding` off loopback without tokens (or without TLS unless `allow_insecure`), `PortInUse`
    when the address cannot be bound, and the store's `StateBusy` when another server holds this state.
    """
    claim = claim or claim_state(settings)
    try:
        config = build_config(settings, allow_insecure=allow_insecure, log_level=log_level, app_factory=app_factory,
                              claim=claim)
        make_server(config, claim.lease).run(sockets=claim.sockets)
    finally:
        claim.release()
