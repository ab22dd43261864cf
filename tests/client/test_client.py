"""`tether.AsyncClient` and `tether.Client` against a real agent server (uvicorn on 127.0.0.1, the task API)
with a real device connected over AIP: every method family, and the errors."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from tests.kits.task import AgentServer
from tether import AsyncClient, Client, Command, Event, ResultStatus, ToolInfo
from tether.agent.run.task import Task, TaskEvent
from tether.client import (
    BatchResults,
    ConnectError,
    Device,
    DeviceDetail,
    FanOutOutcome,
    HTTPStatusError,
    TaskEnd,
    TaskSummary,
)
from tether.tools.policy.model import default_policy


def _echo(root: Path, word: str) -> Command:
    return Command(tool_name="shell.run", parameters={"cmd": "echo", "argv": [word], "cwd": str(root)})


def _write_plan(target: Path) -> list[dict[str, object]]:
    return [{"skill": "write_file", "args": {"file_path": str(target), "content": "x"}}]


async def _server_with_alpha(tmp_path: Path, server: AgentServer) -> Path:
    root = tmp_path / "alpha"
    root.mkdir()
    policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
    await server.add_device("alpha", policy, tmp_path / "state-alpha")
    return root


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_async_client_every_family(tmp_path: Path) -> None:
    async with AgentServer(tmp_path) as server:
        root = await _server_with_alpha(tmp_path, server)
        base = f"http://127.0.0.1:{server.port}"
        admin = server.store.tokens.create("api", "auditor", ["admin"])[1]
        async with AsyncClient(base, server.token, timeout=30) as client, \
                AsyncClient(base, server.agent_token, timeout=30) as agent, AsyncClient(base, admin) as auditor:
            assert (await client.health())["status"] == "ok"
            [row] = await client.devices()
            assert isinstance(row, Device) and row.name == "alpha" and row.status in ("online", "busy")
            assert await client.devices(name="beta-*") == []
            detail = await client.device("alpha")
            assert isinstance(detail, DeviceDetail) and detail.profile is not None and detail.profile.cpu.cores >= 1
            tools = await client.tools("alpha")
            assert all(isinstance(t, ToolInfo) for t in tools) and "shell.run" in {t.name for t in tools}

            # a streamed command: events while it runs, then the results
            items = [item async for item in client.stream("alpha", [_echo(root, "one")], timeout=30)]
            *events, last = items
            assert isinstance(last, BatchResults) and last.device == "alpha" and last.batch
            assert all(isinstance(e, Event) for e in events)
            assert any(e.kind == "output" and "one" in e.data.get("data", "") for e in events)
            assert last.results[0].status is ResultStatus.SUCCESS and last.results[0].result["stdout"] == "one\n"
            assert (await client.batch(last.batch))["state"] == "done"
            seen: list[Event] = []
            chosen = await client.run(None, [_echo(root, "two")], requires={"platform": detail.platform},
                                      on_event=seen.append, timeout=30)
            assert chosen.device == "alpha" and chosen.results[0].ok and seen

            # fan-out
            outcomes: list[FanOutOutcome] = []
            report = await client.fan_out([_echo(root, "all")], on_device=outcomes.append, timeout=30)
            assert report.id and report.summary.total == report.summary.ok == 1
            assert [o.device for o in report.devices] == ["alpha"] == [o.device for o in outcomes]
            assert report.devices[0].results[0].result["stdout"] == "all\n"

            # a task held for a person's approval: the agent's token may not give it, a person's may
            target = root / "approved.txt"
            created = await client.create_task("write", plan=_write_plan(target), device="alpha", confirm="always")
            assert isinstance(created, TaskSummary) and created.device == "alpha"
            async for item in client.task_events(created.id):
                assert isinstance(item, TaskEvent | TaskEnd)
                if isinstance(item, TaskEvent) and item.kind == "question":
                    break
            with pytest.raises(HTTPStatusError) as refused:
                await agent.approve(created.id)
            assert refused.value.status == 403 and "person" in refused.value.message
            approved = await client.approve(created.id)
            assert approved.id == created.id
            end = await client.wait_task(created.id)
            assert end.state == "done" and end.ended and target.read_text() == "x"
            task = await client.task(created.id)
            assert isinstance(task, Task) and task.questions[0].answered_by.startswith("api:tester")
            assert created.id in {t.id for t in await client.tasks()}

            # audit
            page = await auditor.audit(device="alpha", limit=5)
            assert page.rows and all(r["device"] == "alpha" for r in page.rows) and len(page.rows) <= 5

            # errors: the server's words with its status
            with pytest.raises(HTTPStatusError) as missing:
                await client.device("nope")
            assert missing.value.status == 404 and missing.value.message == "no device named 'nope'"
            with pytest.raises(HTTPStatusError) as not_admin:
                await client.audit()
            assert not_admin.value.status == 403
    async with AsyncClient(f"http://127.0.0.1:{_closed_port()}", "t", timeout=5) as nowhere:
        with pytest.raises(ConnectError):
            await nowhere.devices()


def _sync_families(base: str, token: str, root: Path) -> None:
    with Client(base, token, timeout=30) as client:
        assert [d.name for d in client.devices(status="online")] in (["alpha"], [])
        assert client.device("alpha").name == "alpha"
        items = list(client.stream("alpha", [_echo(root, "sync")], timeout=30))
        assert isinstance(items[-1], BatchResults) and items[-1].results[0].result["stdout"] == "sync\n"
        assert any(isinstance(i, Event) and i.kind == "output" for i in items[:-1])
        report = client.fan_out([_echo(root, "fan")], requires={"tags": []}, timeout=30)
        assert report.summary.ok == 1 and report.devices[0].device == "alpha"
        # a task whose plan waits for confirmation, answered by a person
        target = root / "answered.txt"
        created = client.create_task("write", plan=_write_plan(target), device="alpha", confirm="always")
        for item in client.task_events(created.id):
            if isinstance(item, TaskEvent) and item.kind == "question":
                break
        client.answer(created.id, "run")
        assert client.wait_task(created.id).state == "done" and target.read_text() == "x"
        assert client.task(created.id, events=False).events == []
        with pytest.raises(HTTPStatusError) as missing:
            client.tools("nope")
        assert missing.value.status == 404 and "nope" in missing.value.message
        with pytest.raises(HTTPStatusError) as no_batch:
            client.cancel_batch("no-such-batch")
        assert no_batch.value.status == 404
    with Client(f"http://127.0.0.1:{_closed_port()}", token, timeout=5) as nowhere, pytest.raises(ConnectError):
        nowhere.health()


async def test_sync_client_every_family(tmp_path: Path) -> None:
    async with AgentServer(tmp_path) as server:
        root = await _server_with_alpha(tmp_path, server)
        # the server runs on this loop: the blocking client runs in a thread beside it
        await asyncio.to_thread(_sync_families, f"http://127.0.0.1:{server.port}", server.token, root)


def test_bad_url_and_pin_are_value_errors() -> None:
    with pytest.raises(ValueError):
        Client("127.0.0.1:8765")
    with pytest.raises(ValueError):
        AsyncClient("https://127.0.0.1:8765", pin="not-a-fingerprint")
    assert Client("ws://127.0.0.1:8765/aip").base_url == "http://127.0.0.1:8765"
