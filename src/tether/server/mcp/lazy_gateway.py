"""`LazyGateway`: `/mcp` answers from the server's start; the `mcp` SDK is imported on its first use.

Importing the SDK and building the gateway is a large part of a server's start (which must answer /health
soon; bench/ measures it) for a surface many servers never serve. So the route exists from the start, the first
request that passes the token check (front/admission.py) asks for the gateway and waits for it, and every request
after that goes straight to it. A server that never sees a valid /mcp request never imports the SDK.

Where the gateway is built: on the event loop, in one long-lived task that `run()` starts. Not in a worker
thread: CPython 3.11.7 raises "SystemError: AST constructor recursion depth mismatch" when a thread imports
(compiles) while the main thread compiles (gh-106905). Not in the first request's task either: the SDK's
session manager (`Gateway.run()`) is an anyio task group, entered and left by one task, and it must outlive
that request. So the task waits until a request needs the gateway, builds it (the import blocks the loop
once), enters its `run()` and stays inside until the server stops. Concurrent first
requests all wait for that one build; if it fails, /mcp answers 503 `{"error": …}` and the rest of the
server runs on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette

from tether.errors import ServerError
from tether.server.mcp.front.admission import Refused, admit, deny

if TYPE_CHECKING:
    from tether.server.mcp.gateway import Gateway  # the SDK: only once a request needs it

logger = logging.getLogger(__name__)

BUILD_TIMEOUT = 30.0  # how long a first request waits for the build (far longer than it takes)
STOP_TIMEOUT = 10.0  # how long shutdown waits for the gateway's sessions to end before cancelling them


class GatewayUnavailable(ServerError):
    """The gateway could not be had: its build failed or timed out, or the server is stopping."""


class LazyGateway:
    """The ASGI app at `/mcp` (and `app.state.gateway`): the real `Gateway` once `ready()` has built it."""

    def __init__(self, app: Starlette, build: Callable[[Starlette], Gateway]) -> None:
        self.app = app
        self.build = build
        self.gateway: Gateway | None = None  # set while the built gateway runs
        self._failure: str | None = None
        # one set per lifespan: `run()` replaces them when it ends (the next run may be on another loop)
        self._needed = asyncio.Event()
        self._ready = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        gateway = self.gateway
        if gateway is None:
            if scope["type"] != "http":  # a WebSocket to /mcp: MCP has none (as the gateway says)
                await send({"type": "websocket.close", "code": 1008, "reason": "MCP is served over HTTP POST/GET"})
                return
            checked = await admit(self.app.state.bearer, scope)  # the gateway checks again, as on every request
            if isinstance(checked, Refused):  # no SDK import for a request the gateway would refuse
                await deny(scope, receive, send, checked.status, checked.error, checked)
                return
            try:
                gateway = await self.ready()
            except GatewayUnavailable as exc:
                await deny(scope, receive, send, 503, str(exc))
                return
        await gateway(scope, receive, send)

    async def ready(self, timeout: float = BUILD_TIMEOUT) -> Gateway:
        """The running gateway, built now if no request has needed it yet (waits while `run()` has not begun)."""
        if self.gateway is not None:
            return self.gateway
        if self._failure is not None:
            raise GatewayUnavailable(self._failure)
        ready = self._ready
        self._needed.set()
        try:
            async with asyncio.timeout(timeout):
                await ready.wait()
        except TimeoutError:
            raise GatewayUnavailable(f"the MCP gateway did not start within {timeout:g} s; try again, "
                                     "the server log may say why") from None
        if self.gateway is None:
            raise GatewayUnavailable(self._failure or "the server is stopping")
        return self.gateway

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """Entered by the app's lifespan: the task that builds and runs the gateway lives as long as this."""
        needed, ready, stopping = self._needed, self._ready, asyncio.Event()
        task = asyncio.create_task(self._serve(needed, ready, stopping), name="tether mcp gateway")
        try:
            yield
        finally:
            stopping.set()
            if not needed.is_set():
                task.cancel()  # still waiting for a first request: nothing was imported, nothing to close
            done, _ = await asyncio.wait({task}, timeout=STOP_TIMEOUT)
            if not done:
                logger.warning("MCP gateway: sessions still open after %g s; cancelling them", STOP_TIMEOUT)
                task.cancel()
                await asyncio.wait({task}, timeout=STOP_TIMEOUT)
            self.gateway, self._failure = None, None
            self._needed, self._ready = asyncio.Event(), asyncio.Event()

    async def _serve(self, needed: asyncio.Event, ready: asyncio.Event, stopping: asyncio.Event) -> None:
        try:
            await needed.wait()
            if stopping.is_set():
                return
            gateway = self.build(self.app)
            async with gateway.run():  # the SDK's task group: entered and left here, in this one task
                self.gateway = gateway
                ready.set()
                await stopping.wait()
        except Exception as exc:  # an import error, a bug: /mcp says so, the rest of the server runs on
            logger.exception("MCP gateway failed")
            self._failure = (f"the MCP gateway is unavailable ({type(exc).__name__}); "
                             "the server log has the details")
        finally:
            self.gateway = None
            ready.set()  # wakes every waiting request: each gets the gateway, or a 503 saying why not
