"""The fleet as an MCP server: the gateway mounted at `/mcp` on the agent server.

The app factory mounts it; it imports nothing from `server/web`, `server/cluster` or `tether.agent`.
Layers above the server (the agent's task tools) add their tools through `contributed.py`.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.routing import Route

logger = logging.getLogger(__name__)

READY_TIMEOUT = 30.0  # how long a request that arrives while the gateway starts waits for it


def mount_gateway(app: Starlette) -> AbstractAsyncContextManager[None]:
    """Add `/mcp` to `app` (which has `state.hub`, `state.store`, `state.settings`) and return the context
    the app's lifespan enters. The gateway is built there in the background: importing the `mcp` SDK costs
    about 0.5 s, which the server's devices and REST clients need not wait for."""
    mount = _Mount(app)
    # first in the list: every MCP message is a request to this one path
    app.router.routes.insert(0, Route("/mcp", endpoint=mount))
    return mount.run()


class _Mount:
    """The ASGI endpoint at `/mcp`: the gateway once it has started; until then a request waits for it."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.gateway: Any = None
        self.failed: str | None = None
        self._ready: asyncio.Event | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.gateway is None and self.failed is None and self._ready is not None:
            try:
                async with asyncio.timeout(READY_TIMEOUT):
                    await self._ready.wait()
            except TimeoutError:
                pass
        if self.gateway is None:
            await _unavailable(scope, send, self.failed or "the MCP gateway is starting; try again")
            return
        await self.gateway(scope, receive, send)

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        self._ready = asyncio.Event()
        stop = asyncio.Event()
        task = asyncio.create_task(self._serve(stop), name="tether-mcp-gateway")
        try:
            yield
        finally:
            stop.set()
            try:
                async with asyncio.timeout(15):
                    await task
            except TimeoutError:
                task.cancel()

    async def _serve(self, stop: asyncio.Event) -> None:
        assert self._ready is not None
        try:
            module = await asyncio.to_thread(importlib.import_module, "tether.server.mcp.gateway")
            gateway = module.Gateway(self.app)
            async with gateway.run():
                self.app.state.gateway = self.gateway = gateway
                self._ready.set()
                await stop.wait()
        except Exception as exc:
            logger.exception("the MCP gateway failed")
            self.failed = f"the MCP gateway is not available: {exc}"
        finally:
            self.gateway = None
            self._ready.set()


async def _unavailable(scope: dict[str, Any], send: Any, error: str) -> None:
    if scope["type"] != "http":
        await send({"type": "websocket.close", "code": 1013, "reason": ""})
        return
    body = json.dumps({"error": error}).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})
