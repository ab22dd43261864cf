"""The fuzzing suite's shared parts: hypothesis profiles and a real agent server on 127.0.0.1.

Profiles (never loaded globally, so the rest of the test suite keeps its own settings): `fuzz-ci`
(derandomized, small counts; chosen when CI=true), `fuzz-dev` (the default, random, a little more)
and `fuzz-deep` (TETHER_FUZZ_PROFILE=fuzz-deep: many examples, for a long local run). Each test
takes the profile through `fuzz_settings(scale)`, where `scale` weighs its examples by their cost.

`LiveServer` is the real app (`create_agent_app`: REST, tasks, /aip behind the request guard) on
uvicorn, on a socket bound before it starts, in a thread of its own with its own event loop, so the
tests talk to it over real sockets exactly as devices and scripts do. Every log record of ERROR
or above that the server writes is kept: a handler that raised is a finding even when the peer
got a polite answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

import uvicorn
from hypothesis import HealthCheck, Phase, Verbosity, settings

from tests.kits import db as dbkit
from tether.agent.server_app import create_agent_app
from tether.server.settings import ServerSettings
from tether.server.store import Store

WAIT = 10.0  # upper bound for anything that should happen "now"; never a sleep

_COMMON: dict[str, Any] = {
    "deadline": None,  # a socket round trip's time varies on a loaded CI machine
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                              HealthCheck.data_too_large, HealthCheck.filter_too_much],
    "print_blob": True,
}
settings.register_profile("fuzz-ci", max_examples=40, derandomize=True, database=None, **_COMMON)
settings.register_profile("fuzz-dev", max_examples=60, **_COMMON)
settings.register_profile("fuzz-deep", max_examples=2000, verbosity=Verbosity.normal, **_COMMON)

PROFILE = os.environ.get("TETHER_FUZZ_PROFILE") or ("fuzz-ci" if os.environ.get("CI") == "true" else "fuzz-dev")


def fuzz_settings(scale: float = 1.0, **overrides: Any) -> settings:
    """The suite's profile with its example count multiplied by `scale` (at least 5)."""
    base = settings.get_profile(PROFILE)
    count = max(5, int(base.max_examples * scale))
    phases = overrides.pop("phases", None) or tuple(base.phases)
    return settings(base, max_examples=count, phases=phases, **overrides)


NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target)


class ErrorLog(logging.Handler):
    """Keeps every record at ERROR or above from the loggers it is attached to."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def take(self) -> list[str]:
        """The records so far, formatted with their tracebacks, and forget them."""
        formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
        out = [formatter.format(r) for r in self.records]
        self.records.clear()
        return out


@dbkit.keeps_server_state
class LiveServer:
    """A real agent server on 127.0.0.1 in its own thread (see the module docstring)."""

    def __init__(self, tmp: Path, **overrides: Any) -> None:
        values: dict[str, Any] = {**dbkit.settings_db(tmp / "server.db"), "heartbeat_interval": 5.0,
                                  "heartbeat_timeout": 30.0, "grace_period": 2.0, "register_timeout": 5.0,
                                  "max_frame_bytes": 16 * 1024}
        self.settings = ServerSettings(**{**values, **overrides})
        self.store = Store(dbkit.server_db(self.settings.db_path))
        scopes = ["read", "execute", "admin", "approve"]
        _, self.api_token = self.store.tokens.create("api", f"fuzzer-{uuid.uuid4().hex}", scopes)
        _, self.read_token = self.store.tokens.create("api", f"reader-{uuid.uuid4().hex}", ["read"])
        self.device_tokens = {name: self.store.tokens.create("device", name, [])[1]
                              for name in ("fuzz-pre", "fuzz-post", "good", "alpha")}
        self.errors = ErrorLog()
        for name in ("tether", "uvicorn.error", "uvicorn.asgi"):
            logging.getLogger(name).addHandler(self.errors)
        app = create_agent_app(self.settings, self.store)
        self.hub = app.state.hub
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)  # clients that come before uvicorn accepts wait in the backlog
        self.port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.aip = f"ws://127.0.0.1:{self.port}/aip"
        # as `tether.server.main.build_config` does: the transport's limit leaves room above AIP's
        config = uvicorn.Config(app, log_config=None, log_level="warning", lifespan="on",
                                ws_max_size=self.settings.max_frame_bytes * 2, ws_per_message_deflate=False,
                                ws_ping_interval=None, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_ready = threading.Event()
        self.crashed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(sock,), name="fuzz-server", daemon=True)
        self.thread.start()

    def _run(self, sock: socket.socket) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.loop_ready.set()
            await self.server.serve(sockets=[sock])

        try:
            asyncio.run(main())
        except BaseException as exc:  # the test sees it through `alive`
            self.crashed = exc

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.server.should_exit and self.crashed is None

    def call(self, coro: Any, timeout: float = WAIT) -> Any:
        """Run a coroutine on the server's loop (e.g. a scripted device beside it) and wait for it."""
        assert self.loop_ready.wait(WAIT), "the server's event loop did not start"
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Any) -> Any:
        """Start a coroutine on the server's loop without waiting; returns its concurrent future."""
        assert self.loop_ready.wait(WAIT), "the server's event loop did not start"
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def auth(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.api_token}"}

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        for name in ("tether", "uvicorn.error", "uvicorn.asgi"):
            logging.getLogger(name).removeHandler(self.errors)
