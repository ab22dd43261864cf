"""The whole app for fan-out tests: `create_app` under a real uvicorn on 127.0.0.1, scripted AIP devices
(aip_testkit) registered on it, and httpx clients holding execute and read tokens."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from tests.kits import db as dbkit
from tests.kits.aip import WAIT, FakeDevice
from tether.protocol.messages import ServerMessageType
from tether.protocol.profile import DeviceProfile
from tether.server.http.app import create_app
from tether.server.settings import ServerSettings
from tether.server.store import Store


class App:
    def __init__(self, app: Any, store: Store, server: uvicorn.Server, task: asyncio.Task, port: int) -> None:
        self.app, self.store, self.server, self.task, self.port = app, store, server, task, port
        self.hub = app.state.hub
        self.url = f"http://127.0.0.1:{port}"
        self.runner = store.tokens.create("api", "runner", ["execute"])[1]
        self.reader = store.tokens.create("api", "reader", ["read"])[1]

    def http(self, token: str | None = None) -> httpx.AsyncClient:
        token = self.runner if token is None else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=WAIT * 2)

    async def device(self, name: str, tags: list[str] | None = None) -> FakeDevice:
        dev = FakeDevice(f"ws://127.0.0.1:{self.port}/aip", self.store.tokens.create("device", name)[1], name=name,
                         profile=DeviceProfile(tags=tags or []))
        ack = await dev.register()
        assert ack.type is ServerMessageType.REGISTER_ACK, ack
        return dev


@dbkit.keeps_server_state
@asynccontextmanager
async def running_app(tmp_path: Path) -> AsyncIterator[App]:
    db = tmp_path / "server.db"
    settings = ServerSettings(**dbkit.settings_db(db), heartbeat_interval=5.0, heartbeat_timeout=30.0,
                              grace_period=30.0)
    store = Store(dbkit.server_db(db))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    fastapi_app = create_app(settings, store)
    server = uvicorn.Server(uvicorn.Config(fastapi_app, lifespan="on", log_config=None, log_level="warning",
                                           ws_ping_interval=None))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    running = App(fastapi_app, store, server, task, sock.getsockname()[1])
    try:
        yield running
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)
