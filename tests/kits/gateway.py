"""The whole agent server app in-process (uvicorn on 127.0.0.1, lifespan on) and the official `mcp` SDK client
speaking the handshake era of streamable HTTP to its `/mcp`, as desktop and IDE clients do."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx2
import mcp_types as types
import uvicorn
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tests.kits import db as dbkit
from tests.kits.aip import WAIT, FakeDevice
from tether.protocol.models import ToolInfo
from tether.protocol.profile import DeviceProfile
from tether.server.http.app import Extension, create_app
from tether.server.settings import ServerSettings
from tether.server.store import Store

SHELL_RUN = ToolInfo(name="shell.run", namespace="shell", tool_type="action", description="Run a program",
                     input_schema={"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
                     output_schema={"type": "object", "properties": {"exitCode": {"type": "integer"}}})
READ_FILE = ToolInfo(name="files.read", namespace="files", tool_type="data_collection", description="Read a file",
                     input_schema={"type": "object", "properties": {"path": {"type": "string"}}})
LIST_TOOLS = ToolInfo(name="list_tools", namespace="meta", tool_type="data_collection", meta=True)


def profile(*tools: ToolInfo, sandbox: str | None = "bubblewrap") -> DeviceProfile:
    return DeviceProfile(tools=list(tools) or [SHELL_RUN, READ_FILE, LIST_TOOLS], sandbox=sandbox, tags=["lab"])


@dbkit.keeps_server_state
class GatewayServer:
    """An agent server (REST, AIP, /mcp) on a free loopback port; tokens made in its store."""

    def __init__(self, tmp: Path, extensions: Sequence[Extension] = (), **settings: Any) -> None:
        values: dict[str, Any] = {**dbkit.settings_db(tmp / "server.db"), "heartbeat_interval": 5.0,
                                  "heartbeat_timeout": 30.0, "grace_period": 0.5, "register_timeout": 5.0}
        self.settings = ServerSettings(**{**values, **settings})
        self.store = Store(dbkit.server_db(self.settings.db_path))
        self.app = create_app(self.settings, self.store, extensions)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.mcp_url = f"{self.base}/mcp"
        config = uvicorn.Config(self.app, lifespan="on", log_config=None, log_level="warning", ws_ping_interval=None)
        self.server = uvicorn.Server(config)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> GatewayServer:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        return self

    def token(self, name: str, *scopes: str) -> str:
        return self.store.tokens.create("api", name, list(scopes))[1]

    def device(self, name: str, prof: DeviceProfile | None = None) -> FakeDevice:
        secret = self.store.tokens.create("device", name)[1]
        return FakeDevice(f"ws://127.0.0.1:{self.port}/aip", secret, name=name, profile=prof or profile())

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await asyncio.wait_for(self.task, 15)


class Seen:
    """What the server sent the client outside of answers: tool-list changes, as an event to wait on."""

    def __init__(self) -> None:
        self.list_changed = asyncio.Event()

    async def __call__(self, message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self.list_changed.set()


@contextlib.asynccontextmanager
async def mcp_client(url: str, token: str | None, **session: Any) -> AsyncIterator[ClientSession]:
    """An initialized `ClientSession` (the 2025 handshake) with `Authorization: Bearer token`."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(WAIT * 6, read=300.0)) as http, \
            streamable_http_client(url, http_client=http) as (read, write), \
            ClientSession(read, write, read_timeout_seconds=60, **session) as client:
        await client.initialize()
        yield client


async def register(server: GatewayServer, name: str, prof: DeviceProfile | None = None) -> FakeDevice:
    device = server.device(name, prof)
    ack = await device.register()
    assert ack.status.value == "ok", ack
    return device
