"""MCP servers as a device uses them: real processes, real third-party servers, real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import mcp
import pytest
from pydantic import BaseModel

from tether.device.mcp.client.manager import (
    BaseMCPServer,
    HttpServer,
    MCPServerError,
    MCPServerManager,
    ModuleServer,
    StdioServer,
    ToolSetServer,
)
from tether.device.mcp.config.server_config import MCPServerConfig
from tether.protocol.models import Result, ResultStatus
from tether.tools.context import ToolContext
from tether.tools.policy.model import Policy
from tether.tools.runtime import ToolSet, tool
from tether.tools.toolsets.mcp_export import serve_http, toolset_to_mcp

SERVERS = Path(__file__).parent.parent / "servers"
CRASHY = str(SERVERS / "crashy.py")
CTX = ToolContext(policy=Policy(), call_id="test-call")


def make_ctx() -> ToolContext:
    return ToolContext(policy=Policy())


def crashy_config(namespace: str = "crashy", **extra: Any) -> dict[str, Any]:
    return {"namespace": namespace, "server_type": "stdio", "command": sys.executable, "args": [CRASHY],
            "startup_timeout": 20, **extra}


@pytest.fixture
async def manager() -> AsyncIterator[MCPServerManager]:
    mgr = MCPServerManager()
    yield mgr
    await mgr.aclose()


async def started(mgr: MCPServerManager, config: dict[str, Any]) -> BaseMCPServer:
    server = mgr.create_or_get_server(config)
    errors = await mgr.start_servers([server])
    assert errors == {}
    return server


async def call(server: BaseMCPServer, name: str, args: dict[str, Any] | None = None,
               timeout: float = 20) -> Result:
    return await server.call_tool(name, args, ctx=CTX, timeout=timeout)


# --- third-party servers ------------------------------------------------------------------------

async def test_mcp_server_time_from_pypi(manager: MCPServerManager) -> None:
    server = await started(manager, {"namespace": "time", "server_type": "stdio", "command": sys.executable,
                                     "args": ["-m", "mcp_server_time"]})
    assert isinstance(server, StdioServer)
    tools = {t.name: t for t in await server.list_tools("data_collection")}
    assert {"get_current_time", "convert_time"} <= tools.keys()
    assert tools["get_current_time"].tool_type == "data_collection"
    assert tools["get_current_time"].namespace == "time"
    assert "timezone" in tools["get_current_time"].input_schema["properties"]

    ok = await call(server, "get_current_time", {"timezone": "UTC"})
    assert ok.status is ResultStatus.SUCCESS, ok.error
    assert ok.result["structured"]["timezone"] == "UTC" and "datetime" in ok.result["structured"]
    assert ok.call_id == "test-call" and ok.namespace == "time"

    bad = await call(server, "get_current_time", {"timezone": "Not/AZone"})
    assert bad.status is ResultStatus.FAILURE
    assert "'time'" in bad.error and "get_current_time" in bad.error and "Not/AZone" in bad.error


async def test_node_filesystem_server(manager: MCPServerManager, node_mcp_bin: Path, tmp_path: Path) -> None:
    root = tmp_path.resolve()
    server = await started(manager, {"namespace": "fs", "server_type": "stdio", "command": str(node_mcp_bin),
                                     "args": [str(root)]})
    names = {t.name for t in await server.list_tools("action")}
    assert {"write_file", "read_text_file", "list_directory"} <= names

    target = root / "note.txt"
    args = {"path": str(target), "content": "written through MCP"}
    held = await call(server, "write_file", args)  # the server annotates it destructiveHint: true
    assert held.result == {"needs_approval": True, "rule": "approval.mcp_destructive"} and not target.exists()
    wrote = await server.call_tool("write_file", args, ctx=ToolContext(policy=Policy(), approved_by="tester"),
                                   timeout=20)
    assert wrote.ok, wrote.error
    assert target.read_text() == "written through MCP"
    read = await call(server, "read_text_file", {"path": str(target)})
    assert read.ok and read.result["structured"] == {"content": "written through MCP"}

    outside = await call(server, "read_text_file", {"path": "/etc/hostname"})
    assert outside.status is ResultStatus.FAILURE and "denied" in outside.error.lower()


# --- failure handling ---------------------------------------------------------------------------

async def test_crash_during_call_fails_fast_and_restarts(manager: MCPServerManager) -> None:
    server = await started(manager, crashy_config())
    first_pid = (await call(server, "pid")).result["structured"]

    began = time.monotonic()
    crashed = await call(server, "crash", timeout=30)
    elapsed = time.monotonic() - began
    assert crashed.status is ResultStatus.FAILURE
    assert "server 'crashy' died during call 'crash'" in crashed.error
    assert elapsed < 5, f"a dead server must fail the call at once, took {elapsed:.1f}s"

    after = await call(server, "echo", {"text": "back"}, timeout=30)
    assert after.ok, after.error
    assert after.result["structured"] == "back"
    assert server.restarts == 1 and server.healthy
    assert (await call(server, "pid")).result["structured"] != first_pid


async def test_results_is_error_structured_text_image(manager: MCPServerManager) -> None:
    server = await started(manager, crashy_config())
    failed = await call(server, "fail")
    assert failed.status is ResultStatus.FAILURE
    assert "crashy" in failed.error and "fail" in failed.error and "this tool always fails" in failed.error

    assert (await call(server, "add", {"a": 2, "b": 3})).result["structured"] == {"total": 5}
    assert (await call(server, "both")).result["structured"] == {"machine": True}  # structured beats text
    assert (await call(server, "echo", {"text": "plain words"})).result["structured"] == "plain words"
    # {"result": x} from a non-object return is unwrapped; a JSON string stays a string
    assert (await call(server, "echo", {"text": '{"a": [1, 2]}'})).result["structured"] == '{"a": [1, 2]}'
    assert isinstance((await call(server, "pid")).result["structured"], int)
    # without structured content, the text stays text (JSON or not): one shape, structured None
    assert (await call(server, "text_only", {"text": '{"a": [1, 2]}'})).result == {
        "text": '{"a": [1, 2]}', "content": [{"type": "text", "text": '{"a": [1, 2]}'}], "structured": None}
    assert (await call(server, "text_only", {"text": "just words"})).result["text"] == "just words"
    img = (await call(server, "image")).result["content"][0]
    assert img["type"] == "image" and img["mimeType"] == "image/png" and img["data"]

    bad_args = await call(server, "add", {"a": "two", "b": 3})
    assert bad_args.status is ResultStatus.FAILURE and "add" in bad_args.error
    unknown = await call(server, "no_such_tool")
    assert unknown.status is ResultStatus.FAILURE and "no_such_tool" in unknown.error


async def test_call_timeout_then_server_still_works(manager: MCPServerManager) -> None:
    server = await started(manager, crashy_config())
    began = time.monotonic()
    slow = await call(server, "slow", {"seconds": 30}, timeout=0.5)
    assert slow.status is ResultStatus.FAILURE
    assert "timed out" in slow.error and "slow" in slow.error
    assert slow.result == {"timed_out": True, "timeout": 0.5}
    assert time.monotonic() - began < 3
    assert (await call(server, "echo", {"text": "still here"})).result["structured"] == "still here"
    assert server.restarts == 1, "a session whose call timed out is reset: the next call must not queue behind it"


def stdin_pipe(pid: int) -> str:
    """The /proc path of the pipe process `pid` reads its requests from (the SDK's server moves it off fd 0, which
    it points at /dev/null): its one pipe opened for reading."""
    fds = f"/proc/{pid}/fd"
    [found] = [f"{fds}/{n}" for n in os.listdir(fds) if os.readlink(f"{fds}/{n}").startswith("pipe:")
               and int(Path(f"/proc/{pid}/fdinfo/{n}").read_text().split("flags:")[1].split()[0], 8) & 3 == 0]
    return found


async def unread_bytes(pid: int) -> int:
    """How much of what was written to process `pid`'s request pipe it has not read, once there is some (the
    count lives in the kernel, no event can tell us: polled, bounded)."""
    fd = os.open(stdin_pipe(pid), os.O_RDONLY | os.O_NONBLOCK)  # one more reader of that pipe: it reads nothing
    try:
        async with asyncio.timeout(20):
            while True:
                waiting = int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)
                if waiting:
                    return waiting
                await asyncio.sleep(0.01)
    finally:
        os.close(fd)


async def test_a_request_the_server_never_reads_does_not_hold_up_a_call_behind_it(manager: MCPServerManager) -> None:
    """A server that stops reading (here: stopped by a signal) while a request larger than its stdin pipe is
    written to it: the session's one writer waits on the full pipe, and a call made behind it cannot even hand
    its request over (the SDK starts a call's read timeout only once its request is handed to the writer, so
    only the device's own guard in `call_tool` ends such a call: without it this call waits for the first one's
    timeout, here past the test's bound). The call behind ends as timed out (at its timeout, the guard's second
    and the SDK's shielded courtesy cancel, itself bounded at 5 s); the session is reset (ending the first call
    with it) and opened again."""
    server = await started(manager, crashy_config())
    pid = (await call(server, "pid")).result["structured"]
    os.kill(pid, signal.SIGSTOP)
    first = asyncio.create_task(call(server, "echo", {"text": "x" * (1 << 20)}, timeout=120))
    try:
        assert 0 < await unread_bytes(pid) < 1 << 20  # the writer holds the big request: the pipe is full
        async with asyncio.timeout(20):  # bounded here too: a hang is a failure, not a stuck test run
            behind = await call(server, "echo", {"text": "small"}, timeout=1)
            wedged = await first
    finally:
        first.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert behind.status is ResultStatus.FAILURE and behind.result == {"timed_out": True, "timeout": 1}
    assert wedged.status is ResultStatus.FAILURE and "during call 'echo'" in wedged.error, wedged
    assert (await call(server, "echo", {"text": "back"})).result["structured"] == "back"
    assert server.restarts == 1


async def test_a_call_its_batch_times_out_behind_an_unread_request_resets_the_session(
        manager: MCPServerManager) -> None:
    """The device's own path: a batch's deadline (`ctx.deadline`) covers the call, so the batch's timer, not the
    call's guard, ends it, by cancelling it. A request larger than the pipe of a server that stopped reading
    leaves the session's one writer stuck: a cancelled call resets the session as a timed-out one does, or every
    later call to that server would wait behind the stuck writer until its own batch cancelled it in turn."""
    server = await started(manager, crashy_config())
    pid = (await call(server, "pid")).result["structured"]
    os.kill(pid, signal.SIGSTOP)
    loop = asyncio.get_running_loop()
    try:
        deadline = loop.time() + 1
        with pytest.raises(TimeoutError):  # what the batch runner does at the deadline: cancel the call's task
            async with asyncio.timeout_at(deadline):
                await server.call_tool("echo", {"text": "x" * (1 << 20)},
                                       ctx=ToolContext(policy=Policy(), deadline=deadline), timeout=1)
        deadline = loop.time() + 20  # a hang is a failure, not a stuck test run
        async with asyncio.timeout_at(deadline):
            back = await server.call_tool("echo", {"text": "back"}, ctx=ToolContext(policy=Policy(), deadline=deadline),
                                          timeout=20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert back.result["structured"] == "back"
    assert server.restarts == 1 and (await call(server, "pid")).result["structured"] != pid


async def test_bad_commands_fail_clearly_while_others_start(manager: MCPServerManager) -> None:
    missing = manager.create_or_get_server({"namespace": "missing", "server_type": "stdio",
                                            "command": "/nonexistent/tether-no-such-server"})
    exits = manager.create_or_get_server({
        "namespace": "exits", "server_type": "stdio", "command": sys.executable,
        "args": ["-c", "import sys; sys.stderr.write('boom: bad configuration\\n'); sys.exit(3)"]})
    good = manager.create_or_get_server(crashy_config("good"))

    errors = await manager.start_servers([missing, exits, good, {"namespace": "broken", "server_type": "stdio"}])

    assert set(errors) == {"missing", "exits", "broken"}
    assert "invalid configuration" in errors["broken"] and "needs a 'command'" in errors["broken"]
    assert "command not found" in errors["missing"] and "tether-no-such-server" in errors["missing"]
    assert "exited before completing the MCP handshake" in errors["exits"]
    assert "boom: bad configuration" in errors["exits"]
    assert good.healthy and (await call(good, "echo", {"text": "ok"})).result["structured"] == "ok"
    not_started = await call(missing, "anything", timeout=5)
    assert not_started.status is ResultStatus.FAILURE and "command not found" in not_started.error
    with pytest.raises(MCPServerError, match="missing"):
        await missing.list_tools("action")


async def test_startup_timeout(manager: MCPServerManager) -> None:
    server = manager.create_or_get_server({
        "namespace": "mute", "server_type": "stdio", "command": sys.executable,
        "args": ["-c", "import sys; sys.stdin.read()"], "startup_timeout": 1})  # reads, never answers
    began = time.monotonic()
    errors = await manager.start_servers([server])
    assert "no MCP handshake within 1s" in errors["mute"]
    assert time.monotonic() - began < 10


async def test_reset_restarts_marked_servers_before_next_call(manager: MCPServerManager) -> None:
    resettable = await started(manager, crashy_config("resettable", reset=True))
    kept = await started(manager, crashy_config("kept"))
    pids = {s: (await call(s, "pid")).result["structured"] for s in (resettable, kept)}
    manager.reset()
    assert (await call(resettable, "pid")).result["structured"] != pids[resettable]
    assert (await call(kept, "pid")).result["structured"] == pids[kept]
    assert resettable.restarts == 1 and kept.restarts == 0


async def test_close_kills_the_process_and_fails_later_calls() -> None:
    mgr = MCPServerManager()
    server = await started(mgr, crashy_config())
    pid = (await call(server, "pid")).result["structured"]
    assert await mgr.check_health() == {"crashy": True}
    await mgr.aclose()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    closed = await call(server, "echo", {"text": "x"})
    assert closed.status is ResultStatus.FAILURE and "closed" in closed.error


async def test_server_killed_while_idle_is_restarted(manager: MCPServerManager) -> None:
    server = await started(manager, crashy_config())
    pid = (await call(server, "pid")).result["structured"]
    os.kill(pid, 9)
    assert await server.health_check() is False  # tools/list, not ping; either way it notices
    back = await call(server, "pid", timeout=30)
    assert back.ok, back.error
    assert back.result["structured"] != pid and server.restarts == 1


async def test_close_while_starting_ends_the_start(manager: MCPServerManager, tmp_path: Path) -> None:
    # the server says it is up through a FIFO (the test waits on that, not on time), then never answers
    # the handshake: it reads its stdin until the pipe closes
    spawned = tmp_path / "spawned"
    os.mkfifo(spawned)
    read_end = os.open(spawned, os.O_RDONLY | os.O_NONBLOCK)
    keep_open = os.open(spawned, os.O_WRONLY)  # so the read end sees no end-of-file before the server writes
    up = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(up), os.fdopen(read_end, "rb"))
    server = manager.create_or_get_server({
        "namespace": "slowstart", "server_type": "stdio", "command": sys.executable,
        "args": ["-c", f"import sys; open({str(spawned)!r}, 'wb').write(b'up'); sys.stdin.buffer.read()"],
        "startup_timeout": 60})
    starting = asyncio.create_task(server.start())
    try:  # the process is up and the handshake is pending
        assert await asyncio.wait_for(up.readexactly(2), 20) == b"up"
    finally:
        transport.close()
        os.close(keep_open)
    assert not starting.done()
    began = time.monotonic()
    await server.close()
    with pytest.raises(MCPServerError, match="closed while starting"):
        await starting
    assert time.monotonic() - began < 10


# --- sharing ------------------------------------------------------------------------------------

def test_create_or_get_server_shares_by_identity() -> None:
    mgr = MCPServerManager()
    a = mgr.create_or_get_server(crashy_config())
    assert mgr.create_or_get_server(MCPServerConfig.model_validate(crashy_config(timeout=5))) is a
    assert mgr.create_or_get_server(crashy_config(), reset=True, process_name="p1") is not a
    p1 = mgr.create_or_get_server(crashy_config(), reset=True, process_name="p1")
    assert mgr.create_or_get_server(crashy_config(), reset=True, process_name="p1") is p1
    assert mgr.create_or_get_server(crashy_config(), reset=True, process_name="p2") is not p1
    assert mgr.create_or_get_server(crashy_config("other")) is not a


# --- streamable HTTP ----------------------------------------------------------------------------

@pytest.fixture
def http_server() -> Any:
    # the socket listens before the server starts: a client's connection waits in its backlog until the
    # server accepts it, so nothing has to wait for the server to be up
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    proc = subprocess.Popen([sys.executable, CRASHY, "--http-fd", str(sock.fileno())], stderr=subprocess.PIPE,
                            pass_fds=[sock.fileno()])
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    finally:
        sock.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()


async def test_http_server_with_headers(manager: MCPServerManager, http_server: str) -> None:
    server = await started(manager, {"namespace": "web", "server_type": "http", "url": http_server,
                                     "headers": {"X-Tether-Test": "sent-by-tether"}})
    assert isinstance(server, HttpServer)
    assert "add" in {t.name for t in await server.list_tools("action")}
    assert (await call(server, "header", {"name": "X-Tether-Test"})).result["structured"] == "sent-by-tether"
    assert (await call(server, "add", {"a": 40, "b": 2})).result["structured"] == {"total": 42}
    assert (await call(server, "fail")).status is ResultStatus.FAILURE


async def test_serve_http_refuses_non_loopback() -> None:
    with pytest.raises(ValueError, match="not a loopback"):
        await serve_http(toolset_to_mcp(make_toolset(), make_ctx), host="0.0.0.0", port=1)


# --- in-process servers -------------------------------------------------------------------------

async def test_module_server_in_process(manager: MCPServerManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SERVERS))
    server = await started(manager, {"namespace": "mod", "module": "module_server"})
    assert isinstance(server, ModuleServer)
    tools = await server.list_tools("data_collection")
    assert {t.name for t in tools} == {"greet", "count"}
    assert all(t.tool_type == "data_collection" for t in tools)
    assert (await call(server, "greet", {"name": "tether"})).result["structured"] == "hello, tether"
    first = (await call(server, "count")).result["structured"]
    second = (await call(server, "count")).result["structured"]
    assert second == first + 1


async def test_module_without_mcp_attribute(manager: MCPServerManager) -> None:
    errors = await manager.start_servers([{"namespace": "nomcp", "module": "json"}])
    assert "no `mcp` attribute" in errors["nomcp"]


class Area(BaseModel):
    area: float


@tool(tool_type="data_collection")
async def rectangle(width: float, height: float) -> Area:
    """Area of a rectangle."""
    return Area(area=width * height)


@tool(tool_type="action")
async def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


def make_toolset() -> ToolSet:
    return ToolSet("geometry", [rectangle, shout], "shapes")


async def test_toolset_server_calls_directly(manager: MCPServerManager) -> None:
    mgr = MCPServerManager(toolsets={"geometry": make_toolset})
    try:
        server = await started(mgr, {"namespace": "geo", "toolset": "geometry", "reset": True})
        assert isinstance(server, ToolSetServer)
        infos = {i.name: i for i in await server.list_tools("action")}
        assert infos["rectangle"].tool_type == "data_collection"  # its own declared type wins
        assert infos["shout"].namespace == "geo"
        assert (await call(server, "rectangle", {"width": 2.0, "height": 3.0})).result == Area(area=6.0)
        bad = await call(server, "rectangle", {"width": "wide"})
        assert bad.status is ResultStatus.FAILURE and "width" in bad.error
        mgr.reset()
        assert (await call(server, "shout", {"text": "hi"})).result == "HI"
        assert server.restarts == 1
        errors = await mgr.start_servers([{"namespace": "x", "toolset": "nope"}])
        assert "unknown built-in tool set 'nope'" in errors["x"] and "geometry" in errors["x"]
    finally:
        await mgr.aclose()


async def test_toolset_exported_as_mcp_server() -> None:
    toolset = make_toolset()
    async with mcp.Client(toolset_to_mcp(toolset, make_ctx), read_timeout_seconds=10) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        assert listed["rectangle"].input_schema == toolset.specs["rectangle"].input_schema
        assert listed["rectangle"].output_schema == toolset.specs["rectangle"].output_schema

        ok = await client.call_tool("rectangle", {"width": 2, "height": 4.5})
        assert not ok.is_error and ok.structured_content == {"area": 9.0}
        text = await client.call_tool("shout", {"text": "quiet"})
        assert not text.is_error and text.content[0].text == "QUIET"

        invalid = await client.call_tool("rectangle", {"width": "wide", "height": 1})
        assert invalid.is_error
        assert "argument 'width'" in invalid.content[0].text
        missing = await client.call_tool("shout", {})
        assert missing.is_error and "missing required argument 'text'" in missing.content[0].text
        unknown = await client.call_tool("nope", {})
        assert unknown.is_error and "unknown tool 'nope'" in unknown.content[0].text


async def test_exported_toolset_over_stdio(manager: MCPServerManager) -> None:
    server = await started(manager, {"namespace": "math", "server_type": "stdio", "command": sys.executable,
                                     "args": [str(SERVERS / "exported.py")]})
    assert (await call(server, "multiply", {"a": 6, "b": 7})).result["structured"] == {"product": 42}
    refused = await call(server, "refuse", {"reason": "not today"})
    assert refused.status is ResultStatus.FAILURE and "not today" in refused.error
    assert refused.result == {"refused": True}
    bad = await call(server, "multiply", {"a": "six", "b": 7})
    assert bad.status is ResultStatus.FAILURE and "argument 'a'" in bad.error


async def test_concurrent_calls_share_one_session(manager: MCPServerManager) -> None:
    server = await started(manager, crashy_config())
    results = await asyncio.gather(*(call(server, "add", {"a": i, "b": i}) for i in range(20)))
    assert [r.result["structured"]["total"] for r in results] == [2 * i for i in range(20)]
    assert len({(await call(server, "pid")).result["structured"] for _ in range(3)}) == 1
