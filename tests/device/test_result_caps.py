"""Large results are capped at every boundary, quickly, and nothing stalls behind them.

An MCP tool returning 50 MB used to hold the device at 99% CPU for 100 s (the SDK's stdio reader
re-joins a long line chunk by chunk), block every other tool, and make the next call to that server
wait 42 s. Now: the device's stdio transport drops a message over the cap as it streams in and fails
the call at once (`too_large`); an in-process server's result is measured after the call; the REST
answer has its own cap; and the device's exactly-once record keeps full results only within a byte
budget (2,000 results of 1 MB held 2 GB before), while a resend of the latest batch still gets them.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.kits import db as dbkit
from tests.kits.netutil import Cluster, wait_for
from tether.device.link.batch_runner import BatchRunner
from tether.device.link.finished import FinishedRecord, result_bytes
from tether.device.link.outbox import Outbox
from tether.device.local import build_device
from tether.device.mcp.client.manager import BaseMCPServer, MCPServerManager
from tether.device.mcp.client.stdio import LineSplitter, Oversized
from tether.protocol.codec import decode_client_message
from tether.protocol.messages import ServerMessage, ServerMessageType
from tether.protocol.models import Command, Result, ResultStatus
from tether.tools.context import ToolContext
from tether.tools.policy.model import Policy, default_policy

BULKY = str(Path(__file__).parent.parent / "servers" / "bulky.py")
CTX = ToolContext(policy=Policy(), call_id="caps")


def bulky(namespace: str = "bulky", **extra: Any) -> dict[str, Any]:
    return {"namespace": namespace, "server_type": "stdio", "command": sys.executable, "args": [BULKY],
            "startup_timeout": 20, **extra}


@pytest.fixture
async def manager() -> AsyncIterator[MCPServerManager]:
    mgr = MCPServerManager()
    yield mgr
    await mgr.aclose()


async def started(mgr: MCPServerManager, *configs: dict[str, Any]) -> list[BaseMCPServer]:
    servers = [mgr.create_or_get_server(c) for c in configs]
    assert await mgr.start_servers(servers) == {}
    return servers


# --- the MCP boundary ---------------------------------------------------------------------------

async def test_a_50_mb_mcp_result_fails_fast_as_too_large_while_other_tools_answer(manager) -> None:
    big, other = await started(manager, bulky(), bulky("other"))
    pid = (await big.call_tool("pid", None, ctx=CTX, timeout=20)).result
    began = time.monotonic()
    call = asyncio.ensure_future(big.call_tool("big", {"megabytes": 50}, ctx=CTX, timeout=60))
    meanwhile: list[float] = []  # another server's tool, called over and over while the big answer streams in
    while not call.done():
        t0 = time.monotonic()
        echoed = await other.call_tool("echo", {"text": "still here"}, ctx=CTX, timeout=20)
        assert echoed.ok and echoed.result["structured"] == "still here"
        meanwhile.append(time.monotonic() - t0)
    failed = call.result()
    elapsed = time.monotonic() - began
    assert failed.status is ResultStatus.FAILURE and "too large" in failed.error and "'big'" in failed.error
    assert failed.result["too_large"] is True and failed.result["limit"] >= 4 * 1024 * 1024
    assert elapsed < 10, f"the too-large failure took {elapsed:.1f}s (it took 16-100 s before)"
    assert meanwhile and max(meanwhile) < 2, f"another tool waited {max(meanwhile):.2f}s"
    began = time.monotonic()
    again = await big.call_tool("echo", {"text": "next"}, ctx=CTX, timeout=20)
    assert again.ok and again.result["structured"] == "next", again.error
    assert time.monotonic() - began < 5
    assert (await big.call_tool("pid", None, ctx=CTX, timeout=20)).result == pid, "the session stayed up"
    assert big.restarts == 0


async def test_the_cap_is_configurable_and_results_under_it_pass(manager) -> None:
    [server] = await started(manager, bulky(max_result_bytes=100_000))
    small = await server.call_tool("big", {"megabytes": 0.05}, ctx=CTX, timeout=20)
    assert small.ok and small.result["text"] == "x" * 50_000
    for tool in ("big", "big_structured"):
        over = await server.call_tool(tool, {"megabytes": 0.5}, ctx=CTX, timeout=20)
        assert over.status is ResultStatus.FAILURE and "too large" in over.error, (tool, over)
        assert over.result["too_large"] is True
    assert (await server.call_tool("echo", {"text": "ok"}, ctx=CTX, timeout=20)).result["structured"] == "ok"


async def test_an_in_process_server_result_is_measured_too(manager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "servers"))
    [server] = await started(manager, {"namespace": "mod", "module": "bulky", "max_result_bytes": 100_000})
    over = await server.call_tool("big", {"megabytes": 0.5}, ctx=CTX, timeout=20)
    assert over.status is ResultStatus.FAILURE and "too large" in over.error
    assert over.result == {"too_large": True, "bytes": 500_000, "limit": 100_000, "complete": True}
    assert (await server.call_tool("echo", {"text": "ok"}, ctx=CTX, timeout=20)).result["structured"] == "ok"


def test_a_results_size_counts_every_kind_of_content_block() -> None:
    """What `result_size` counts of each block kind (text, image/audio data, an embedded resource's text or
    blob), the larger of that and the structured content, and that counting stops past the limit."""
    import mcp_types as t

    from tether.device.mcp.client.session_util import result_size

    blocks: list[Any] = [t.TextContent(type="text", text="abc"),
                         t.ImageContent(type="image", data="QUJD", mime_type="image/png"),
                         t.AudioContent(type="audio", data="QUJDRA==", mime_type="audio/wav"),
                         t.ResourceLink(type="resource_link", uri="file:///x", name="x"),
                         t.EmbeddedResource(type="resource", resource=t.TextResourceContents(uri="file:///a",
                                                                                             text="hello")),
                         t.EmbeddedResource(type="resource", resource=t.BlobResourceContents(uri="file:///b",
                                                                                             blob="QUJDRA=="))]
    assert result_size(t.CallToolResult(content=blocks), 1 << 20) == 3 + 4 + 8 + 5 + 8
    structured = {"rows": ["x" * 100]}
    assert result_size(t.CallToolResult(content=blocks[:1], structured_content=structured), 1 << 20) == len(
        json.dumps(structured, separators=(",", ":")))
    assert result_size(t.CallToolResult(content=[t.TextContent(type="text", text="x" * 50)] * 3), 60) == 100


def test_the_line_splitter_is_linear_bounded_and_finds_the_request_id() -> None:
    splitter = LineSplitter(limit=100)
    assert splitter.feed(b'{"a":1}\n{"b"') == [b'{"a":1}']
    assert splitter.feed(b':2}\n') == [b'{"b":2}']
    # the Python SDK's order (jsonrpc, id, result): answered as soon as the line passes the limit
    head = b'{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"'
    [early] = splitter.feed(head + b"x" * 200)
    assert isinstance(early, Oversized) and early.request_id == 7 and not early.done
    assert splitter.feed(b"x" * 10_000) == []
    end, line = splitter.feed(b'"}]}}\n{"ok":1}\n')
    assert isinstance(end, Oversized) and end.done and end.request_id is None and end.size > 10_000
    assert line == b'{"ok":1}'
    # the TypeScript SDK's order (result, jsonrpc, id): answered when the line ends
    [late] = splitter.feed(b'{"result":{"text":"' + b"y" * 500 + b'"},"jsonrpc":"2.0","id":"r-9"}\n')
    assert isinstance(late, Oversized) and late.done and late.request_id == "r-9"
    # a request or notification of the server's own is dropped, never answered as if it were a response
    [note] = splitter.feed(b'{"jsonrpc":"2.0","id":3,"method":"sampling/createMessage","params":"' + b"z" * 500
                           + b'"}\n')
    assert isinstance(note, Oversized) and note.request_id is None
    [kept] = splitter.feed(b'{"small":true}\n')
    assert kept == b'{"small":true}'


# --- the device's exactly-once record -----------------------------------------------------------

async def test_the_record_stays_within_its_byte_budget_and_a_resend_still_gets_its_results(tmp_path) -> None:
    roots = [str(tmp_path)]
    policy = default_policy().model_copy(update={"read_roots": roots, "write_roots": roots})
    device = build_device(policy=policy, state_dir=tmp_path / "state", sandbox=False)
    megabyte = tmp_path / "mb.txt"
    megabyte.write_text("m" * 1_000_000)
    budget = 8 * 1024 * 1024
    record = FinishedRecord(max_bytes=budget)
    outbox = Outbox()
    outbox.open(4 * 1024 * 1024)
    runner = BatchRunner(device.client, outbox, record, client_id="dev-1")

    async def run(msg: ServerMessage) -> list[Result]:
        runner.submit(msg)
        await runner.idle.wait()
        results = []
        while (frame := outbox.pop()) is not None:
            results += decode_client_message(frame[1], 1 << 30).action_results or []
        return results

    def batch() -> ServerMessage:
        reads = [Command(tool_name="read_file", parameters={"file_path": str(megabyte)}) for _ in range(2)]
        return ServerMessage(type=ServerMessageType.COMMAND, actions=reads, timeout=30)

    try:
        sent = [batch() for _ in range(100)]  # 200 results of 1 MB
        for msg in sent:
            results = await run(msg)
            assert [r.status for r in results] == [ResultStatus.SUCCESS] * 2
            assert record.bytes <= budget, f"the record holds {record.bytes} bytes (budget {budget})"
        assert runner.executed == 200 and len(record) == 200
        full = sum(result_bytes(r) for r in record._results.values())
        assert full <= budget + 200 * 1024, f"{full} bytes held"
        latest = await run(sent[-1])  # a resend after a reconnect: answered from the record, in full
        assert [r.result["content"] for r in latest] == ["m" * 1_000_000] * 2
        oldest = await run(sent[0])  # long gone from the budget: never run again, and says so
        assert [r.status for r in oldest] == [ResultStatus.SUCCESS] * 2
        assert all(r.result is None and "no longer held" in r.error for r in oldest)
        assert runner.executed == 200
    finally:
        await device.aclose()


# --- the REST boundary --------------------------------------------------------------------------

@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    c.server.stop()  # the same server, with a small response cap
    c.server = c.start(["server", "--port", str(c.port), *dbkit.server_db_args(c.db), "--heartbeat-interval", "0.3",
                        "--heartbeat-timeout", "2", "--grace-period", "3", "--log-level", "warning",
                        "--max-response-bytes", "300000"], "server-capped")
    wait_for(lambda: c.remote.health()["status"] == "ok", "server health", procs=(c.server.popen,))
    yield c
    c.close()


def test_a_rest_answer_over_its_cap_replaces_the_largest_results(cluster, tmp_path):
    alpha = cluster.device("alpha")
    cluster.wait_online("alpha", alpha)
    big = tmp_path / "big.txt"
    big.write_text("b" * 400_000)
    small = tmp_path / "small.txt"
    small.write_text("small")
    cmds = [Command(tool_name="read_file", parameters={"file_path": str(p)}) for p in (big, small)]
    body = {"commands": [c.model_dump(exclude_none=True) for c in cmds], "timeout": 30}
    answer = cluster.remote._http.post("/devices/alpha/commands", json=body)
    assert answer.status_code == 200 and len(answer.content) <= 300_000
    first, second = json.loads(answer.content)["results"]
    assert first["status"] == "failure" and "too large for this response" in first["error"]
    assert first["result"] == {"too_large": True, "bytes": first["result"]["bytes"], "limit": 300_000,
                               "status": "success"} and first["result"]["bytes"] > 400_000
    assert second["status"] == "success" and second["result"]["content"] == "small"
    events: list[Any] = []
    _, streamed = cluster.remote.run("alpha", cmds, timeout=30, on_event=events.append)
    assert streamed[0].status is ResultStatus.FAILURE and streamed[0].result["too_large"] is True
    assert streamed[1].ok
