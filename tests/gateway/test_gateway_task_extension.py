"""`run_task` as a task of MCP's tasks extension, and `subscriptions/listen` for every list, against real
`tether server` and `tether device` processes, spoken in raw 2026-07-28 HTTP as the specifications write it
(ext-tasks `specification/2026-07-28/tasks.md`; SEP-2575), plus the official Python SDK's 2025 session for
the handshake era's `list_changed` notifications. One server and device for the module."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import mcp_types as types
import pytest

from tests.device.test_mcp_resources import EVERYTHING, config, everything_bin  # noqa: F401 (fixture)
from tests.gateway.test_gateway_2026 import TASKS, Raw, V, _sleeping, settled
from tests.kits.gateway import mcp_client
from tests.kits.netutil import Cluster, wait_for

WAIT = 60
NODE_MODULES = Path(__file__).resolve().parents[2] / ".tether-test-node" / "node_modules"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("gateway-task-ext")
    c = Cluster(tmp, ("--heartbeat-timeout", "30"))
    work = tmp / "work"  # outside the device's temp dir: deleting there needs a person's approval
    work.mkdir()
    (tmp / "device-temp").mkdir()
    policy = tmp / "policy.yaml"
    policy.write_text(f"ask: on-miss\nread_roots: [{json.dumps(str(tmp))}]\nwrite_roots: [{json.dumps(str(tmp))}]\n")
    try:
        proc = c.device("alpha", extra=("--policy", str(policy)), env={"TMPDIR": str(tmp / "device-temp")})
        c.wait_online("alpha", proc)
        c.alpha_pid = proc.pid  # type: ignore[attr-defined]
        c.policy = policy  # type: ignore[attr-defined]
        yield c
    finally:
        c.close()


@pytest.fixture
async def raw(cluster: Cluster) -> AsyncIterator[Raw]:
    async with httpx2.AsyncClient(timeout=60) as http:
        yield Raw(http, f"http://127.0.0.1:{cluster.port}/mcp", cluster.api_token, TASKS)


def shell(cmd: str, argv: list[str], cwd: Path) -> dict[str, Any]:
    return {"skill": "shell.run", "args": {"cmd": cmd, "argv": argv, "cwd": str(cwd)}}


class Frames(list[dict[str, Any]]):
    """The frames of a listen stream as they come: `opened` once acknowledged, `arrived` at each frame."""

    def __init__(self) -> None:
        super().__init__()
        self.opened, self.arrived = asyncio.Event(), asyncio.Event()

    def add(self, frame: dict[str, Any]) -> None:
        self.append(frame)
        if frame.get("method") == "notifications/subscriptions/acknowledged":
            self.opened.set()
        self.arrived.set()

    async def first(self, check: Any) -> dict[str, Any]:
        """The first frame meeting `check`, waiting for each new frame (bounded)."""
        async with asyncio.timeout(WAIT):
            while (found := next((f for f in self if check(f)), None)) is None:
                self.arrived.clear()
                if next((f for f in self if check(f)), None) is None:
                    await self.arrived.wait()
            return found


async def listen(raw: Raw, notifications: dict[str, Any], frames: Frames) -> None:
    """A `subscriptions/listen` stream, each frame added to `frames` as it comes."""
    raw.ids += 1
    meta = {"io.modelcontextprotocol/protocolVersion": V, "io.modelcontextprotocol/clientCapabilities":
            raw.capabilities, "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "2026"}}
    headers = {"Authorization": f"Bearer {raw.token}", "Accept": "application/json, text/event-stream",
               "Content-Type": "application/json", "MCP-Protocol-Version": V, "Mcp-Method": "subscriptions/listen"}
    body = {"jsonrpc": "2.0", "id": raw.ids, "method": "subscriptions/listen",
            "params": {"notifications": notifications, "_meta": meta}}
    async with raw.http.stream("POST", raw.url, json=body, headers=headers) as response:
        assert response.headers["content-type"].startswith("text/event-stream"), await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line[5:].strip():
                frames.add(json.loads(line[5:]))


async def test_run_task_is_a_task_polled_and_told_to_its_end(raw: Raw, cluster: Cluster) -> None:
    work = cluster.tmp / "work"
    handle = await raw.result("tools/call", {"name": "run_task", "arguments": {
        "device": "alpha", "plan": [shell("echo", ["hello from a task"], work)]}})
    assert handle["resultType"] == "task" and handle["status"] in ("working", "completed"), handle
    task_id = handle["taskId"]
    assert {"createdAt", "lastUpdatedAt", "ttlMs", "pollIntervalMs"} <= handle.keys()

    frames = Frames()
    stream = asyncio.create_task(listen(raw, {"taskIds": [task_id, "no-such-task"]}, frames))
    try:
        await asyncio.wait_for(frames.opened.wait(), WAIT)
        ack = frames[0]["params"]
        assert ack["notifications"] == {"taskIds": [task_id]}  # an unknown id is not agreed to
        told = await frames.first(lambda f: f.get("method") == "notifications/tasks"
                                  and f["params"]["status"] == "completed")
    finally:
        stream.cancel()
    assert told["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == raw.ids
    async with httpx2.AsyncClient(timeout=60) as fresh:  # a client that reconnects: nothing but the token kept
        done = await settled(Raw(fresh, raw.url, cluster.api_token, TASKS), task_id, "completed", "failed",
                             "cancelled")
    assert done["status"] == "completed" and not done["result"].get("isError"), done
    summary = done["result"]["structuredContent"]
    assert summary["task_id"] == task_id and summary["status"] == "done"
    assert "hello from a task" in json.dumps(done["result"]) or summary["steps"][0]["status"] == "success"
    assert {k: v for k, v in told["params"].items() if k != "_meta"} == {k: v for k, v in done.items()
                                                                          if k not in ("_meta", "resultType")}
    # the tether task it is: the REST API shows the same task, done
    assert cluster.remote._request("GET", f"/tasks/{task_id}")["state"] == "done"

    # another token (and a stateless client: a new connection each time) does not reach it
    other = Raw(raw.http, raw.url, cluster.read_token, TASKS)
    for method in ("tasks/get", "tasks/cancel"):
        refused = (await other.post(method, {"taskId": task_id})).json()
        assert refused["error"]["code"] == -32602 and "not found" in refused["error"]["message"], refused
    frames = Frames()
    theirs = asyncio.create_task(listen(other, {"taskIds": [task_id]}, frames))
    try:
        await asyncio.wait_for(frames.opened.wait(), WAIT)
    finally:
        theirs.cancel()
    assert frames[0]["params"]["notifications"] == {"taskIds": []}
    raw.capabilities = {}  # without the extension declared, task ids are not listened for
    assert (await raw.post("subscriptions/listen", {"notifications": {"taskIds": [task_id]}})
            ).json()["error"]["code"] == -32021
    raw.capabilities = TASKS


async def test_cancelling_the_task_stops_its_command_on_the_device(raw: Raw, cluster: Cluster) -> None:
    work = cluster.tmp / "work"
    marker = work / "after-the-cancel"
    handle = await raw.result("tools/call", {"name": "run_task", "arguments": {"device": "alpha", "plan": [
        shell("sleep", ["303"], work), shell("touch", [str(marker)], work)]}})
    task_id = handle["taskId"]
    pid: int = cluster.alpha_pid  # type: ignore[attr-defined]
    process = await asyncio.to_thread(wait_for, lambda: _sleeping(pid, "303"), "sleep 303 on the device", WAIT)
    working = await raw.result("tasks/get", {"taskId": task_id})
    assert working["status"] == "working" and "step 1" in working.get("statusMessage", ""), working
    other = Raw(raw.http, raw.url, cluster.read_token, TASKS)
    assert (await other.post("tasks/cancel", {"taskId": task_id})).json()["error"]["code"] == -32602
    assert process.is_running()  # another token's cancel stopped nothing

    acknowledged = await raw.result("tasks/cancel", {"taskId": task_id})
    assert acknowledged["resultType"] == "complete" and set(acknowledged) <= {"resultType", "_meta"}
    ended = await settled(raw, task_id, "completed", "failed", "cancelled")
    assert ended["status"] == "cancelled", ended
    await asyncio.to_thread(process.wait, 15)  # psutil.TimeoutExpired if it was left running
    shown = cluster.remote._request("GET", f"/tasks/{task_id}")
    assert shown["state"] == "cancelled"
    assert not marker.exists()  # the step after the cancel point never ran


async def test_an_approval_waits_as_input_required_and_is_answered_by_tasks_update(raw: Raw, cluster: Cluster
                                                                                    ) -> None:
    victim = cluster.tmp / "work" / "old"
    victim.mkdir()
    handle = await raw.result("tools/call", {"name": "run_task", "arguments": {
        "device": "alpha", "plan": [shell("rm", ["-r", str(victim)], victim.parent)]}})
    waiting = await settled(raw, handle["taskId"], "input_required", "completed", "failed", "cancelled")
    assert waiting["status"] == "input_required", json.dumps(waiting)[:1500]
    [(key, question)] = waiting["inputRequests"].items()
    assert key.startswith("q-") and question["method"] == "elicitation/create"
    assert "rm" in question["params"]["message"]
    options = question["params"]["requestedSchema"]["properties"]["answer"]["enum"]
    assert victim.exists()
    await raw.result("tasks/update", {"taskId": handle["taskId"], "inputResponses": {
        "q-unknown": {"action": "accept", "content": {"answer": "approve"}},  # ignored: not an open key
        key: {"action": "accept", "content": {"answer": options[0]}}}})
    done = await settled(raw, handle["taskId"], "completed", "failed", "cancelled")
    assert done["status"] == "completed" and done["result"]["structuredContent"]["status"] == "done", done
    assert not victim.exists()


async def test_a_device_call_s_task_is_told_on_the_listen_stream_too(raw: Raw, cluster: Cluster) -> None:
    victim = cluster.tmp / "work" / "kept"
    victim.mkdir()
    handle = await raw.result("tools/call", {"name": "alpha__shell.run", "arguments": {
        "cmd": "rm", "argv": ["-r", str(victim)], "cwd": str(victim.parent)}})  # asks at once: a task
    assert handle["resultType"] == "task" and handle["status"] == "input_required", handle
    frames = Frames()
    stream = asyncio.create_task(listen(raw, {"taskIds": [handle["taskId"]]}, frames))
    try:
        now = await frames.first(lambda f: f.get("method") == "notifications/tasks")
        assert now["params"]["status"] == "input_required"  # where it stands, right after the acknowledgement
        [key] = now["params"]["inputRequests"]
        await raw.result("tasks/update", {"taskId": handle["taskId"], "inputResponses": {
            key: {"action": "accept", "content": {"decision": "deny"}}}})
        told = await frames.first(lambda f: f.get("method") == "notifications/tasks"
                                  and f["params"]["status"] == "completed")
    finally:
        stream.cancel()
    assert told["params"]["result"]["isError"] and "denied" in json.dumps(told["params"]["result"])
    assert victim.exists()


async def test_the_typescript_sdk_runs_run_task_as_a_2025_task_and_answers_its_approval(raw: Raw, cluster: Cluster
                                                                                          ) -> None:
    """The official TypeScript SDK's 2025-11-25 tasks: tools/call with `task`, tasks/get, tasks/result (which asks
    the approval through elicitation), notifications/tasks/status, tasks/list; another token's tasks/get refused."""
    victim = cluster.tmp / "work" / "older"
    victim.mkdir()
    arguments = {"device": "alpha", "plan": [shell("rm", ["-r", str(victim)], victim.parent)]}
    process = await asyncio.create_subprocess_exec(
        "node", str(Path(__file__).parent / "node" / "run_task.cjs"), raw.url, cluster.api_token, cluster.read_token,
        json.dumps(arguments), "approve", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "NODE_PATH": str(NODE_MODULES)})
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report["taskSupport"] == "optional" and "error" not in report, report
    kinds = [m.split("@")[0] for m in report["messages"]]
    assert kinds[0] == "taskCreated" and kinds[-1] == "result", report
    assert "taskStatus:input_required" in kinds, report
    [asked] = report["asked"]
    assert "rm" in asked, report
    result = report["result"]
    assert not result.get("isError") and result["structuredContent"]["status"] == "done", report
    assert result["_meta"]["io.modelcontextprotocol/related-task"] == {"taskId": report["taskId"]}
    assert not victim.exists()
    assert report["end"] == "told" and report["notified"][-1] == "completed", report  # told on its stream
    assert report["taskId"] in report["listed"]
    assert report["otherError"] == -32602, report
    assert cluster.remote._request("GET", f"/tasks/{report['taskId']}")["state"] == "done"


async def test_listeners_hear_when_a_device_brings_resources_and_prompts(raw: Raw, cluster: Cluster,
                                                                         everything_bin: Path,  # noqa: F811
                                                                         tmp_path: Path) -> None:
    frames = Frames()
    told: dict[str, asyncio.Event] = {m: asyncio.Event() for m in ("resources", "prompts")}

    async def legacy(message: Any) -> None:  # the 2025 session's notifications on its standing stream
        if isinstance(message, types.ResourceListChangedNotification):
            told["resources"].set()
        elif isinstance(message, types.PromptListChangedNotification):
            told["prompts"].set()

    lists = {"resourcesListChanged": True, "promptsListChanged": True, "toolsListChanged": True}
    stream = asyncio.create_task(listen(raw, {k: True for k in list(lists)[:2]}, frames))
    # a token scoped to alpha hears nothing of beta (nor does it learn that beta exists)
    scoped = cluster.remote._request("POST", "/tokens", json={"kind": "api", "name": "alpha-only",
                                                              "scopes": ["read"], "devices": ["alpha"]})["token"]
    narrow = Frames()
    narrow_stream = asyncio.create_task(listen(Raw(raw.http, raw.url, scoped, {}), lists, narrow))
    beta = None
    try:
        async with mcp_client(raw.url, cluster.api_token, message_handler=legacy) as session:
            capabilities = session.server_capabilities
            assert capabilities is not None and capabilities.resources is not None and capabilities.prompts is not None
            assert capabilities.resources.list_changed and capabilities.prompts.list_changed
            await asyncio.wait_for(frames.opened.wait(), WAIT)
            await asyncio.wait_for(narrow.opened.wait(), WAIT)
            assert frames[0]["params"]["notifications"] == {"resourcesListChanged": True, "promptsListChanged": True}
            beta = cluster.device("beta", extra=("--policy", str(cluster.policy),  # type: ignore[attr-defined]
                                                 "--config", str(config(tmp_path, EVERYTHING))))
            for kind in ("resources", "prompts"):
                await frames.first(lambda f, k=kind: f.get("method") == f"notifications/{k}/list_changed")
                await asyncio.wait_for(told[kind].wait(), WAIT)
            assert not any(f.get("method") == "notifications/tools/list_changed" for f in frames)  # not asked for
            assert [f["method"] for f in narrow] == ["notifications/subscriptions/acknowledged"]
            resources = await raw.result("resources/list")
            assert any(r["uri"].startswith("tether://beta/everything/") for r in resources["resources"])

            # the REST tool list gives the servers' titles and annotations when asked (and only then: an
            # earlier CLI validates each tool with a model that refuses fields it does not know)
            plain = await asyncio.to_thread(cluster.remote._request, "GET", "/devices/beta/tools")
            assert not any({"title", "annotations"} & t.keys() for t in plain)
            hinted = await asyncio.to_thread(cluster.remote.tools, "beta", hints=True)
            mcp_tools = {t["name"]: t for t in (await raw.result("tools/list"))["tools"]}
            hinted_here = {t.name: (t.title, t.annotations) for t in hinted if t.annotations}
            assert hinted_here and all(
                (mcp_tools[f"beta__{name}"].get("title"), mcp_tools[f"beta__{name}"].get("annotations")) == hints
                for name, hints in hinted_here.items()), (hinted_here, mcp_tools)
    finally:
        stream.cancel()
        narrow_stream.cancel()
        if beta is not None:
            beta.stop()
