"""Sampling (an external MCP server's `sampling/createMessage`, reaching the server's LLM through its device)
is charged to the command it serves (issue 27): only a caller whose token holds the `sample` scope causes
it, within caps per call, per token and minute and per request size, and every request is audited with
that caller.

Tried as an attacker would: a person's token without `sample` runs a tool whose MCP server samples (refused
clearly; the LLM is never asked); a device that is not a real one (a raw AIP socket proving its key) asks
the server's LLM with no command running, floods one command's call past the cap, and sends an oversized
request. Real things: a `tether server` process with an LLM (a real HTTP server speaking the Chat
Completions protocol), a `tether device` process serving tests/servers/interactive.py (a real stdio MCP
server that samples), REST, and a raw WebSocket for the forged device.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.kit.fake_llm import FakeLLM
from tests.kits.aip import FakeDevice
from tests.kits.netutil import Cluster, wait_for
from tether.protocol.messages import ClientMessage, ClientMessageType, ServerMessageType, TaskStatus
from tether.protocol.models import Result, ResultStatus

INTERACTIVE = str(Path(__file__).parent.parent / "servers" / "interactive.py")


class LLMThread:
    """The scripted LLM server on its own event loop in a thread, so one serves the whole module."""

    def __init__(self, replies: list[str]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fake = FakeLLM(list(replies))
        asyncio.run_coroutine_threadsafe(self.fake.start(), self.loop).result(30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.fake.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


class Sampling:
    """The server (its LLM the scripted one), device `alpha` (mcp_sampling: on, the interactive MCP server),
    and API tokens: `plain` (a person: read, execute), `writer` (read, execute, sample)."""

    def __init__(self, tmp: Path) -> None:
        self.llm = LLMThread([f"reply {n}" for n in range(40)])
        saved = dict(os.environ)
        os.environ.update({"TETHER_LLM_BASE_URL": self.llm.fake.base_url, "TETHER_LLM_MODEL": "fake-model",
                           "TETHER_LLM_API_KEY": "test-key"})
        try:
            self.cluster = Cluster(tmp)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        config, policy = tmp / "mcp.json", tmp / "policy.yaml"
        config.write_text(json.dumps({"mcpServers": {"interactive": {"command": sys.executable,
                                                                       "args": [INTERACTIVE]}}}))
        policy.write_text(json.dumps({"mcp_sampling": "on"}))
        proc = self.cluster.device("alpha", extra=("--config", str(config), "--policy", str(policy)))
        self.cluster.wait_online("alpha", proc)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.cluster.port}/api/v1", timeout=60)
        self.admin = {"Authorization": f"Bearer {self.cluster.api_token}"}
        self.secrets: dict[str, str] = {}
        for name, scopes in (("plain", ["read", "execute"]), ("writer", ["read", "execute", "sample"])):
            made = self.http.post("/tokens", json={"kind": "api", "name": name, "scopes": scopes},
                                  headers=self.admin)
            assert made.status_code == 201, made.text
            self.secrets[name] = made.json()["token"]
        wait_for(lambda: "sample" in self.http.get("/devices/alpha/tools", headers=self.admin).text,
                 "alpha lists the interactive server's tools", 60, (proc.popen,))

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secrets[who]}"}

    def run(self, who: str, device: str, tool: str, params: dict[str, Any]) -> dict[str, Any]:
        body = {"commands": [{"tool_name": tool, "parameters": params}], "timeout": 60}
        done = self.http.post(f"/devices/{device}/commands", json=body, headers=self.auth(who))
        assert done.status_code == 200, done.text
        [result] = done.json()["results"]
        return result

    def sampling_rows(self, device: str) -> list[dict[str, Any]]:
        rows = self.http.get("/audit", params={"device": device, "limit": 500}, headers=self.admin).json()
        listed = rows if isinstance(rows, list) else rows.get("rows", [])
        return [r for r in listed if r["tool_name"] == "mcp.sampling"]

    def close(self) -> None:
        self.http.close()
        self.cluster.close()
        self.llm.close()


@pytest.fixture(scope="module")
def sampling(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sampling]:
    s = Sampling(tmp_path_factory.mktemp("sampling"))
    try:
        yield s
    finally:
        s.close()


def test_a_caller_without_the_sample_scope_cannot_make_the_device_sample(sampling: Sampling) -> None:
    asked_before = len(sampling.llm.fake.requests)
    result = sampling.run("plain", "alpha", "sample", {"prompt": "spend the server's tokens"})
    said = json.dumps(result)
    assert "sampling refused: token 'plain'" in said and "'sample' scope" in said, said
    assert len(sampling.llm.fake.requests) == asked_before  # the LLM was never asked
    [row] = [r for r in sampling.sampling_rows("alpha") if r["requested_by"] == "api:plain"]
    assert row["status"] == "failure" and "'sample' scope" in row["error"], row


def test_a_caller_holding_sample_is_answered_and_audited(sampling: Sampling) -> None:
    result = sampling.run("writer", "alpha", "sample", {"prompt": "name a colour"})
    assert result["status"] == "success" and "fake-model: reply" in json.dumps(result["result"]), result
    assert sampling.llm.fake.requests[-1]["messages"][-1]["content"] == "name a colour"
    rows = [r for r in sampling.sampling_rows("alpha") if r["requested_by"] == "api:writer"]
    assert len(rows) == 1 and rows[0]["status"] == "success" and rows[0]["call_id"] == result["call_id"], rows


def _sample_frame(call_id: str, text: str = "hello", **extra: Any) -> tuple[str, ClientMessage]:
    ident = uuid.uuid4().hex
    payload = {"server": "evil", "call_id": call_id, "messages": [{"role": "user", "content": text}],
               "system_prompt": None, "max_tokens": 50, "temperature": None, **extra}
    return ident, ClientMessage(type=ClientMessageType.SAMPLING_REQUEST, client_id="beta", prev_response_id=ident,
                                payload=payload)


async def test_a_forged_device_cannot_spend_the_servers_llm(sampling: Sampling) -> None:
    """A device connection (beta's token, its key enrolled on first use) that owes no result asks for a
    completion; then, while a real caller's command runs on it, floods that call past the cap and sends an
    oversized request. Only the capped number reach the LLM, each audited with the command's caller."""
    url = f"ws://127.0.0.1:{sampling.cluster.port}/aip"
    forged = FakeDevice(url, sampling.cluster.device_tokens["beta"], name="beta")
    ack = await forged.register()
    assert ack.status is TaskStatus.OK, ack
    asked_before = len(sampling.llm.fake.requests)

    async def ask(call_id: str, **extra: Any) -> Any:
        ident, frame = _sample_frame(call_id, **extra)
        await forged.send(frame)
        reply = await forged.expect(ServerMessageType.SAMPLING_REPLY)
        assert reply.response_id == ident
        return reply

    idle = await ask("made-up-call")
    assert idle.status is TaskStatus.FAILED and "no command is running on device beta" in (idle.error or "")

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sampling.cluster.port}/api/v1", timeout=60) as api:
        running = asyncio.create_task(api.post("/devices/beta/commands", headers=sampling.auth("writer"), json={
            "commands": [{"tool_name": "anything", "parameters": {}}], "timeout": 60}))
        command = await forged.expect(ServerMessageType.COMMAND)
        [action] = command.actions or []
        replies = [await ask(action.call_id) for _ in range(6)]
        huge = await ask(action.call_id, messages=[{"role": "user", "content": "x" * 70_000}])
        await forged.results(command.response_id, [Result(status=ResultStatus.SUCCESS, result={},
                                                          call_id=action.call_id)])
        assert (await running).status_code == 200
    await forged.close()
    assert [r.status for r in replies[:5]] == [TaskStatus.OK] * 5
    assert replies[5].status is TaskStatus.FAILED and "at most 5" in (replies[5].error or ""), replies[5]
    assert huge.status is TaskStatus.FAILED and "sampling refused" in (huge.error or ""), huge
    assert len(sampling.llm.fake.requests) == asked_before + 5
    rows = sampling.sampling_rows("beta")
    assert [r["requested_by"] for r in rows].count("device:beta") == 1  # the one with no command: no caller
    mine = [r for r in rows if r["requested_by"] == "api:writer"]
    assert sorted(r["status"] for r in mine) == ["failure"] * 2 + ["success"] * 5, mine
