"""The whole agent server in-process (uvicorn on 127.0.0.1, lifespan on, the task API) and real devices.

    async with AgentServer(tmp_path, llm=fake.settings()) as server:
        await server.add_device("alpha", policy)      # build_device + a real DeviceConnection over AIP
        task = await server.api.post("/tasks", json={...})
        events = await server.events_until(task_id, lambda e: e["kind"] == "question")

Nothing waits by sleeping: the listening socket exists before uvicorn serves it (a client that comes
early waits in the backlog), devices are awaited on `connected`, and events are read from the
task's server-sent event stream until the one a test wants arrives (each read bounded by WAIT).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from tests.kits import db as dbkit
from tests.kits.aip import key_for
from tether.agent.llm.settings import LLMSettings
from tether.agent.run.task import Budgets
from tether.agent.server_app import create_agent_app
from tether.device.link.connection import DeviceConnection
from tether.device.local import LocalDevice, build_device
from tether.device.probe import collect_profile
from tether.server.settings import ServerSettings
from tether.server.store import Store
from tether.tools.policy.model import Policy

WAIT = 30.0


@dbkit.keeps_server_state
class AgentServer:
    def __init__(self, tmp: Path, *, llm: LLMSettings | None = None, budgets: Budgets | None = None,
                 db_path: Path | None = None, **settings: Any) -> None:
        self.tmp = tmp
        self.settings_extra = settings  # more ServerSettings (e.g. four_eyes=True)
        self.llm = llm
        self.budgets = budgets
        self.db_path = db_path or tmp / "server.db"
        self.devices: list[tuple[LocalDevice, DeviceConnection, asyncio.Task[None]]] = []

    async def __aenter__(self) -> AgentServer:
        settings = ServerSettings(**dbkit.settings_db(self.db_path), heartbeat_interval=5.0, heartbeat_timeout=30.0,
                                  grace_period=5.0, **self.settings_extra)
        self.store = Store(dbkit.server_db(settings.db_path))
        token = self.store.tokens.create("api", f"tester-{len(self.store.tokens.all())}",
                                        ["read", "execute", "approve", "sample"])[1]
        # what an agent would hold: it may run tasks but not approve its own dangerous actions
        self.agent_token = self.store.tokens.create("api", f"agent-{len(self.store.tokens.all())}",
                                                   ["read", "execute"])[1]
        self.app = create_agent_app(settings, self.store, llm_settings=self.llm, budgets=self.budgets)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, lifespan="on", log_config=None, log_level="warning",
                                ws_per_message_deflate=False, ws_ping_interval=None)
        self.server = uvicorn.Server(config)
        self._serving = asyncio.create_task(self.server.serve(sockets=[sock]))
        self.api = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}/api/v1",
                                     headers={"Authorization": f"Bearer {token}"}, timeout=WAIT)
        self.token = token
        return self

    @property
    def tasks(self) -> Any:
        return self.app.state.tasks

    async def add_device(self, name: str, policy: Policy, state_dir: Path) -> LocalDevice:
        """A real device (built-in tools, this policy) connected over AIP and registered."""
        device = build_device(policy=policy, state_dir=state_dir, client_id=name)
        token = self.store.tokens.create("device", name)[1]
        link = DeviceConnection(device.client, f"ws://127.0.0.1:{self.port}/aip", token, name=name,
                                profile=lambda: collect_profile(device), key=key_for(name))  # one key per name
        job = asyncio.create_task(link.run())
        self.devices.append((device, link, job))
        await asyncio.wait_for(link.connected.wait(), WAIT)
        return device

    async def drop_device(self, name: str) -> None:
        """Stop a device's connection (it stays registered, now offline)."""
        for device, link, job in list(self.devices):
            if link.name == name:
                link.stop()
                await asyncio.wait_for(job, WAIT)
                await device.aclose()
                self.devices.remove((device, link, job))
        hub = self.app.state.hub
        await hub.registry.wait_until(lambda: not hub.connected(name), WAIT)

    async def create(self, **body: Any) -> dict[str, Any]:
        response = await self.api.post("/tasks", json=body)
        assert response.status_code == 201, response.text
        return response.json()

    async def events_until(self, task_id: str, want: Callable[[dict[str, Any]], bool], after: int = -1
                           ) -> list[dict[str, Any]]:
        """Task events from the SSE stream (after `after`) up to and including the first `want` accepts,
        or up to the end of the stream."""
        seen: list[dict[str, Any]] = []
        async with asyncio.timeout(WAIT), self.api.stream("GET", f"/tasks/{task_id}/events",
                                                          params={"after": after}) as response:
            assert response.status_code == 200
            event_name = None
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    event_name = line[6:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:])
                    if event_name == "end":
                        seen.append({"kind": "end", "data": data, "seq": None})
                        return seen
                    seen.append(data)
                    if want(data):
                        return seen
        return seen

    async def finished(self, task_id: str) -> dict[str, Any]:
        """The task once its event stream has ended."""
        await self.events_until(task_id, lambda e: False)
        response = await self.api.get(f"/tasks/{task_id}")
        assert response.status_code == 200, response.text
        return response.json()

    async def __aexit__(self, *exc: object) -> None:
        await self.api.aclose()
        # the server first, as when it is restarted under running tasks; then the devices
        self.server.should_exit = True
        await asyncio.wait_for(self._serving, WAIT)
        for _, link, _ in self.devices:
            link.stop()
        await asyncio.gather(*(job for _, _, job in self.devices), return_exceptions=True)
        for device, _, _ in self.devices:
            await device.aclose()
