"""issue 13, fast start-up: `/mcp` exists from the server's start, and the `mcp` SDK is imported (the gateway
built) on the first request to it that carries a valid token (server/mcp/lazy_gateway.py).

What a server imported is read from `sys.modules` of a real server process (a fresh interpreter serving the
whole agent app with uvicorn, which reports its modules when asked on stdin), never from timing."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.kits import db as dbkit
from tests.kits.aip import WAIT
from tests.kits.gateway import GatewayServer, mcp_client, register
from tests.kits.netutil import tether_env
from tether.server.mcp.lazy_gateway import GatewayUnavailable, LazyGateway

SDK = ("mcp", "mcp_types")

# The agent server app (as `tether server` builds it) on a socket bound before it starts; stdin lines:
# "modules" prints which of the SDK's packages are imported, "stop" stops the server and prints them again.
_SERVER = """
import asyncio, json, socket, sys
import uvicorn
from tether.agent.server_app import create_agent_app
from tether.server.settings import ServerSettings

def loaded():
    return sorted({name.split(".")[0] for name in sys.modules} & {"mcp", "mcp_types"})

async def main():
    settings = ServerSettings(**json.loads(sys.argv[1]))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # requests wait in the backlog until uvicorn has started
    server = uvicorn.Server(uvicorn.Config(create_agent_app(settings, llm_settings=None), lifespan="on",
                                           log_config=None, log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    print("port", sock.getsockname()[1], json.dumps(loaded()), flush=True)
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async for line in reader:
        if line.strip() == b"stop":
            server.should_exit = True
            await serving
            print("stopped", json.dumps(loaded()), flush=True)
            return
        print("modules", json.dumps(loaded()), flush=True)

asyncio.run(main())
"""


PROCESS_WAIT = 120.0  # upper bound for the server process's start and stop (5 s was missed under load)


@dbkit.keeps_server_state
class ServerProcess:
    """A fresh interpreter serving the agent app; `modules()` asks it which SDK packages it has imported."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.db = tmp / "server.db"
        values = {key: str(value) for key, value in dbkit.settings_db(self.db).items()}
        self.settings = json.dumps(values)
        self.proc: asyncio.subprocess.Process | None = None
        self.base = ""

    def tokens(self, *specs: tuple[str, str, list[str]]) -> list[str]:
        return dbkit.create_tokens(dbkit.server_db(self.db), specs)

    async def start(self) -> list[str]:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _SERVER, self.settings, env=tether_env(self.tmp), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        # a fresh interpreter importing the agent app: a loaded machine needs more than WAIT
        _, port, loaded = (await self._line(PROCESS_WAIT)).split(" ", 2)
        self.base = f"http://127.0.0.1:{port}"
        return json.loads(loaded)

    async def _line(self, bound: float = WAIT) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), bound)
        assert line, f"the server process ended: {await self.stderr()}"
        return line.decode().strip()

    async def modules(self) -> list[str]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(b"modules\n")
        kind, loaded = (await self._line()).split(" ", 1)
        assert kind == "modules"
        return json.loads(loaded)

    async def stop(self) -> tuple[list[str], int, str]:
        """Stop the server: (the SDK packages imported at the end, the exit code, its stderr)."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(b"stop\n")
        kind, loaded = (await self._line(PROCESS_WAIT)).split(" ", 1)  # uvicorn's graceful shutdown
        assert kind == "stopped"
        code = await asyncio.wait_for(self.proc.wait(), PROCESS_WAIT)
        return json.loads(loaded), code, await self.stderr()

    async def stderr(self) -> str:
        assert self.proc is not None and self.proc.stderr is not None
        return (await asyncio.wait_for(self.proc.stderr.read(), WAIT)).decode(errors="replace")

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()


@pytest.fixture
async def process(tmp_path: Path) -> AsyncIterator[ServerProcess]:
    server = ServerProcess(tmp_path)
    yield server
    server.kill()
    if server.proc is not None:
        await server.proc.wait()


MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "curl", "version": "1"}}}


async def test_the_server_answers_without_importing_the_sdk_and_stops_cleanly(process: ServerProcess) -> None:
    [reader, device] = process.tokens(("api", "reader", ["read"]), ("device", "laptop", []))
    assert await process.start() == []
    async with httpx2.AsyncClient(base_url=process.base, timeout=WAIT) as http:
        assert (await http.get("/api/v1/health")).status_code == 200
        listed = await http.get("/api/v1/devices", headers={"Authorization": f"Bearer {reader}"})
        assert listed.status_code == 200, listed.text
        # refused before the SDK is needed: no token, a device token
        missing = await http.post("/mcp", json=INIT, headers=MCP_HEADERS)
        assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Bearer "), missing.text
        assert missing.json() == {"error": "missing bearer token: send 'Authorization: Bearer <api token>'"}
        wrong = await http.post("/mcp", json=INIT, headers={**MCP_HEADERS, "Authorization": f"Bearer {device}"})
        assert wrong.status_code == 403 and "device token" in wrong.json()["error"], wrong.text
    assert await process.modules() == [], "the server imported the mcp SDK without a valid /mcp request"
    loaded, code, stderr = await process.stop()
    assert (loaded, code) == ([], 0), stderr
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr


async def test_the_first_mcp_call_builds_the_gateway(process: ServerProcess) -> None:
    [token] = process.tokens(("api", "agent", ["read"]))
    assert await process.start() == []
    async with mcp_client(f"{process.base}/mcp", token) as client:
        names = [tool.name for tool in (await client.list_tools()).tools]
        assert "list_devices" in names and "run_on_fleet" in names and "run_task" in names, names
        devices = await client.call_tool("list_devices", {})
        assert not devices.is_error, devices
    assert await process.modules() == list(SDK)
    _, code, stderr = await process.stop()
    assert code == 0 and "Traceback" not in stderr, stderr


# -- in-process: one build for concurrent first requests, and what a failed build answers ----------------------


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[GatewayServer]:
    running = await GatewayServer(tmp_path).start()
    yield running
    await running.stop()


def counted(lazy: LazyGateway) -> list[Any]:
    """Every gateway `lazy` builds, in order (its `build` wrapped)."""
    built: list[Any] = []
    build = lazy.build

    def counting(app: Any) -> Any:
        built.append(build(app))
        return built[-1]

    lazy.build = counting
    return built


async def test_concurrent_first_calls_share_one_build(server: GatewayServer) -> None:
    lazy: LazyGateway = server.app.state.gateway
    built = counted(lazy)
    laptop = await register(server, "laptop")
    token = server.token("agent", "read")

    async def first_call() -> list[str]:
        async with mcp_client(server.mcp_url, token) as client:
            return sorted(tool.name for tool in (await client.list_tools()).tools)

    one, two, three = await asyncio.gather(first_call(), first_call(), first_call())
    assert one == two == three and "laptop__shell.run" in one, one
    assert len(built) == 1 and lazy.gateway is built[0]
    assert await lazy.ready() is built[0]
    await laptop.close()


async def test_a_failed_build_answers_503_with_an_error_body(server: GatewayServer) -> None:
    lazy: LazyGateway = server.app.state.gateway

    def broken(app: Any) -> Any:
        raise ImportError("No module named 'mcp'")

    lazy.build = broken
    token = server.token("agent", "read")
    async with httpx2.AsyncClient(timeout=WAIT) as http:
        answers = await asyncio.gather(*(http.post(server.mcp_url, json=INIT, headers={
            **MCP_HEADERS, "Authorization": f"Bearer {token}"}) for _ in range(2)))
        again = await http.post(server.mcp_url, json=INIT, headers={**MCP_HEADERS, "Authorization": f"Bearer {token}"})
        health = await http.get(f"{server.base}/api/v1/health")
    for answer in [*answers, again]:
        assert answer.status_code == 503, answer.text
        assert answer.json() == {"error": "the MCP gateway is unavailable (ImportError); the server log has the "
                                          "details"}
    assert health.status_code == 200, "the rest of the server runs on"
    with pytest.raises(GatewayUnavailable, match="ImportError"):
        await lazy.ready()


async def test_ready_before_the_server_runs_waits_and_then_times_out(tmp_path: Path) -> None:
    """Nothing builds the gateway until the app's lifespan has entered `run()`: a wait for it ends at its bound."""
    server = GatewayServer(tmp_path)  # never started
    lazy: LazyGateway = server.app.state.gateway
    with pytest.raises(GatewayUnavailable, match="did not start within"):
        await lazy.ready(timeout=0.05)
    assert lazy.gateway is None
    server.store.close()
