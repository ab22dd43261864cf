"""`/mcp` as the MCP 2026-07-28 specification has it, spoken in raw HTTP as the specification writes it
(no SDK between: every request carries its version, capabilities and client in `_meta` and the
`Mcp-Method`/`Mcp-Name` headers), and the gateway passing an external server's results, resources and
prompts on as the server gave them. Real `tether server` and `tether device` processes, the device running
the real `@modelcontextprotocol/server-everything` (npm) and an ask-on-miss policy; the server's direct
answers (its own stdio session, the official `mcp` SDK client) are what the gateway's are compared with.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.device.test_mcp_resources import EVERYTHING, config, everything_bin  # noqa: F401 (fixture)
from tests.kits.gateway import mcp_client
from tests.kits.netutil import Cluster, wait_for

V = "2026-07-28"
PAGE = 5  # the server's mcp_page_size here: every list of the module comes in several pages
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("gateway2026")
    # a loaded machine must not drop the device mid-module
    c = Cluster(tmp, ("--heartbeat-timeout", "30", "--set", f"mcp_page_size={PAGE}"))
    policy = tmp / "policy.yaml"
    policy.write_text("ask: on-miss\n")
    try:
        proc = c.device("alpha", extra=("--policy", str(policy), "--config", str(config(tmp, EVERYTHING))))
        c.wait_online("alpha", proc)
        c.alpha_pid = proc.pid  # type: ignore[attr-defined]
        # the device registers before its external server has started; its tools join the profile later
        wait_for(lambda: any(t["name"] == "get-tiny-image" for t in c.remote._request(
            "GET", "/devices/alpha/tools", params={"live": "false"})),  # what the gateway lists: the profile
            "server-everything's tools on alpha", 60)
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def direct(everything_bin: Path) -> dict[str, Any]:  # noqa: F811
    """server-everything's own answers, over its own stdio session: what the gateway must pass on."""
    import asyncio

    import mcp_types as types
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    def dump(model: Any) -> Any:
        return model.model_dump(mode="json", by_alias=True, exclude_none=True)

    async def ask() -> dict[str, Any]:
        async with stdio_client(StdioServerParameters(command=str(everything_bin), args=["stdio"])) as (r, w), \
                ClientSession(r, w) as session:
            await session.initialize()
            tools = {t.name: t for t in (await session.list_tools()).tools}
            doc = await session.read_resource("demo://resource/static/document/features.md")
            prompt = types.PromptReference(type="ref/prompt", name="completable-prompt")
            names = await session.complete(prompt, {"name": "name", "value": ""}, {"department": "Engineering"})
            ids = await session.complete(types.ResourceTemplateReference(
                type="ref/resource", uri="demo://resource/dynamic/text/{resourceId}"), {"name": "resourceId",
                                                                                        "value": "1"})
            return {"weather_schema": tools["get-structured-content"].output_schema,
                    "hints": {n: (t.title, dump(t.annotations) if t.annotations else None) for n, t in tools.items()},
                    "image": dump(await session.call_tool("get-tiny-image", {}))["content"],
                    "weather": (await session.call_tool("get-structured-content",
                                                        {"location": "New York"})).structured_content,
                    "features": dump(doc.contents[0])["text"],
                    "departments": dump((await session.complete(prompt, {"name": "department", "value": ""}))
                                        .completion),
                    "names": dump(names.completion), "ids": dump(ids.completion),
                    "prompt": [dump(m) for m in (await session.get_prompt(
                        "args-prompt", {"city": "Oslo", "state": "Oslo"})).messages]}

    return asyncio.run(ask())


class Raw:
    """A 2026-07-28 client in plain HTTP: one POST per request, nothing kept between them."""

    def __init__(self, http: httpx2.AsyncClient, url: str, token: str, capabilities: dict[str, Any]) -> None:
        self.http, self.url, self.token, self.capabilities = http, url, token, capabilities
        self.ids = 0

    async def post(self, method: str, params: dict[str, Any] | None = None, *, headers: dict[str, str] | None = None,
                   meta: dict[str, Any] | None = None) -> httpx2.Response:
        self.ids += 1
        params = dict(params or {})
        params["_meta"] = {"io.modelcontextprotocol/protocolVersion": V,
                           "io.modelcontextprotocol/clientCapabilities": self.capabilities,
                           "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "2026"}, **(meta or {})}
        sent = {"Authorization": f"Bearer {self.token}", "Accept": "application/json, text/event-stream",
                "Content-Type": "application/json", "MCP-Protocol-Version": V, "Mcp-Method": method}
        name = params.get("name", params.get("uri", params.get("taskId")))
        if isinstance(name, str):
            sent["Mcp-Name"] = name
        return await self.http.post(self.url, json={"jsonrpc": "2.0", "id": self.ids, "method": method,
                                                    "params": params}, headers={**sent, **(headers or {})})

    async def every(self, method: str, field: str) -> list[dict[str, Any]]:
        """Every item of a paginated list, following `nextCursor` (bounded); each page checked to be bounded."""
        items: list[dict[str, Any]] = []
        cursor: str | None = None
        for _ in range(100):
            got = await self.result(method, {"cursor": cursor} if cursor else {})
            assert len(got[field]) <= PAGE, (method, len(got[field]))
            items += got[field]
            cursor = got.get("nextCursor")
            if cursor is None:
                return items
        raise AssertionError(f"{method} never ended")

    async def result(self, method: str, params: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        response = await self.post(method, params, **kw)
        assert response.status_code == 200, response.text
        body = _body(response)
        assert "result" in body, body
        return body["result"]  # type: ignore[no-any-return]


def _body(response: httpx2.Response) -> dict[str, Any]:
    """The JSON-RPC answer, from a JSON body or (a call that streamed) the last SSE event's data."""
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
        return json.loads(next(e for e in reversed(events) if e))  # type: ignore[no-any-return]
    return response.json()  # type: ignore[no-any-return]


@pytest.fixture
async def raw(cluster: Cluster) -> AsyncIterator[Raw]:
    async with httpx2.AsyncClient(timeout=60) as http:
        yield Raw(http, f"http://127.0.0.1:{cluster.port}/mcp", cluster.api_token, {"elicitation": {"form": {}}})


async def test_a_stateless_session_discovers_lists_and_calls(raw: Raw, cluster: Cluster,
                                                             direct: dict[str, Any]) -> None:
    found = await raw.result("server/discover")
    assert V in found["supportedVersions"] and found["resultType"] == "complete"
    assert {"tools", "resources", "prompts"} <= found["capabilities"].keys()
    assert found["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "tether"

    listed = await raw.result("tools/list")
    assert listed["ttlMs"] == 10_000 and listed["cacheScope"] == "private"  # the token's own view of the fleet
    tools = {t["name"]: t for t in await raw.every("tools/list", "tools")}
    # the server's own output schema, not the device's envelope around it
    assert tools["alpha__get-structured-content"]["outputSchema"] == direct["weather_schema"]

    # each external tool's own title and annotations as the server gave them; tether's by their tool type
    hinted = {name: hints for name, hints in direct["hints"].items() if hints[1]}
    assert hinted, "server-everything annotates some of its tools"
    for name, (title, hints) in direct["hints"].items():
        if f"alpha__{name}" in tools:
            assert (tools[f"alpha__{name}"].get("title"), tools[f"alpha__{name}"].get("annotations")) == \
                (title, hints), name
    assert tools["alpha__get_system_info"]["annotations"]["readOnlyHint"] is True
    assert tools["alpha__shell.run"]["annotations"] == {"readOnlyHint": False, "destructiveHint": True,
                                                        "openWorldHint": True}

    # an image passes intact, once, between the server's own text items; no envelope as structured content
    image = await raw.result("tools/call", {"name": "alpha__get-tiny-image", "arguments": {}},
                             meta={"traceparent": TRACE})
    assert image["content"] == direct["image"] and "structuredContent" not in image
    [png] = [c for c in image["content"] if c["type"] == "image"]
    assert base64.b64decode(png["data"]).startswith(b"\x89PNG")
    rows = cluster.remote._request("GET", "/audit", params={"device": "alpha", "limit": 20})["rows"]
    assert any(r["tool_name"] == "get-tiny-image" and r["requested_by"] ==
               f"mcp:raw/2026 traceparent={TRACE} by api:tests" for r in rows), rows

    # a built-in tool's result is still one JSON text with its structured twin
    info = await raw.result("tools/call", {"name": "alpha__get_system_info", "arguments": {}})
    assert [c["type"] for c in info["content"]] == ["text"] and json.loads(info["content"][0]["text"]) == \
        info["structuredContent"]

    weather = await raw.result("tools/call", {"name": "alpha__get-structured-content",
                                              "arguments": {"location": "New York"}})
    assert weather["structuredContent"] == direct["weather"]

    # the routing headers must say what the body says
    lying = await raw.post("tools/call", {"name": "alpha__get-tiny-image", "arguments": {}},
                           headers={"Mcp-Name": "alpha__echo"})
    assert lying.status_code == 400 and lying.json()["error"]["code"] == -32020
    wrong = await raw.post("tools/list", headers={"Mcp-Method": "tools/call"})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == -32020
    future = await raw.post("tools/list", headers={"MCP-Protocol-Version": "2099-01-01"},
                            meta={"io.modelcontextprotocol/protocolVersion": "2099-01-01"})
    assert future.status_code == 400 and V in json.dumps(future.json()["error"])


async def test_an_approval_completes_by_the_multi_round_trip_form(raw: Raw, tmp_path: Path) -> None:
    call = {"name": "alpha__shell.run", "arguments": {"cmd": "nproc", "argv": ["--all"], "cwd": str(tmp_path)}}
    asked = await raw.result("tools/call", call)
    assert asked["resultType"] == "input_required", asked
    question = asked["inputRequests"]["approval"]
    assert question["method"] == "elicitation/create" and "`nproc --all`" in question["params"]["message"]
    assert "approve once" in question["params"]["requestedSchema"]["properties"]["decision"]["enum"]
    done = await raw.result("tools/call", {**call, "requestState": asked["requestState"], "inputResponses": {
        "approval": {"action": "accept", "content": {"decision": "approve once"}}}})
    assert done["resultType"] == "complete" and not done["isError"], done
    assert done["structuredContent"]["exitCode"] == 0
    # the answer is good once: the same state again is no approval
    again = await raw.result("tools/call", {**call, "requestState": asked["requestState"], "inputResponses": {
        "approval": {"action": "accept", "content": {"decision": "approve once"}}}})
    assert again["isError"] and "belongs to no question" in again["content"][0]["text"]

    # an external server's question cannot be put to a 2026 client mid-call without the tasks extension:
    # the server is told at once (cancelled), rather than the call waiting out the question's timeout
    asked_mid_call = await raw.result("tools/call", {"name": "alpha__trigger-elicitation-request",
                                                     "arguments": {}})
    assert "cancel" in json.dumps(asked_mid_call).lower(), asked_mid_call

    raw.capabilities = {}  # a client that cannot be asked is told at once, and nothing ran
    refused = await raw.result("tools/call", call)
    assert refused["resultType"] == "complete" and refused["isError"]
    assert "cannot be asked" in refused["content"][0]["text"]


async def test_resources_and_prompts_of_the_devices_servers(raw: Raw, cluster: Cluster, direct: dict[str, Any]) -> None:
    listed = await raw.result("resources/list")
    assert listed["ttlMs"] == 10_000 and listed["cacheScope"] == "private"
    by_uri = {r["uri"]: r for r in await raw.every("resources/list", "resources")}
    uri = "tether://alpha/everything/demo%3A%2F%2Fresource%2Fstatic%2Fdocument%2Ffeatures.md"
    assert by_uri[uri]["name"] == "features.md" and by_uri[uri]["_meta"]["tether/device"] == "alpha"
    read = await raw.result("resources/read", {"uri": uri})
    assert read["contents"][0]["text"] == direct["features"] and read["contents"][0]["uri"] == uri
    missing = await raw.post("resources/read", {"uri": "tether://elsewhere/everything/x"})
    assert missing.status_code == 400 and missing.json()["error"]["code"] == -32602  # the spec's not-found

    # the handshake era reads them too (the official SDK client), templates expanded as RFC 6570 says
    async with mcp_client(raw.url, raw.token) as client:
        [text_template] = [t.uri_template for t in (await client.list_resource_templates()).resource_templates
                           if "dynamic%2Ftext" in t.uri_template]
        blob = await client.read_resource(text_template.replace("{resourceId}", "4"))
        assert blob.contents[0].text.startswith("Resource 4: This is a plaintext resource")  # type: ignore[union-attr]
        prompts = {p.name for p in (await client.list_prompts()).prompts}
        assert {"alpha__everything__simple-prompt", "alpha__everything__args-prompt"} <= prompts
        got = await client.get_prompt("alpha__everything__args-prompt", {"city": "Oslo", "state": "Oslo"})
        assert [m.model_dump(mode="json", by_alias=True, exclude_none=True) for m in got.messages] == direct["prompt"]
        # a tool's resource link is followed at /mcp
        links = await client.call_tool("alpha__get-resource-links", {"count": 1})
        [link] = [c for c in links.content if c.type == "resource_link"]
        assert str(link.uri).startswith("tether://alpha/everything/")
        followed = await client.read_resource(link.uri)
        assert followed.contents


async def test_lists_come_in_bounded_pages_in_both_generations(raw: Raw) -> None:
    import mcp_types as types
    from mcp.shared.exceptions import MCPError

    tools = await raw.every("tools/list", "tools")
    names = [t["name"] for t in tools]
    assert len(names) > 2 * PAGE and len(set(names)) == len(names) and "alpha__get-tiny-image" in names
    resources = await raw.every("resources/list", "resources")
    assert len(resources) > PAGE  # server-everything's resources, also past one page
    for method in ("tools/list", "resources/list", "resources/templates/list", "prompts/list"):
        bad = await raw.post(method, {"cursor": "not-a-cursor"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == -32602, bad.text
    # a cursor is only good for the list that gave it
    cursor = (await raw.result("tools/list"))["nextCursor"]
    other = await raw.post("prompts/list", {"cursor": cursor})
    assert other.status_code == 400 and other.json()["error"]["code"] == -32602

    # the handshake era pages the same way (the official SDK client, one cursor at a time)
    async with mcp_client(raw.url, raw.token) as client:
        seen: list[str] = []
        page = await client.list_tools()
        while True:
            assert len(page.tools) <= PAGE
            seen += [t.name for t in page.tools]
            if page.next_cursor is None:
                break
            page = await client.list_tools(params=types.PaginatedRequestParams(cursor=page.next_cursor))
        assert seen == names
        with pytest.raises(MCPError) as refused:
            await client.list_prompts(params=types.PaginatedRequestParams(cursor="bm90LWl0"))
        assert refused.value.error.code == -32602


async def test_completion_is_answered_by_the_server_that_owns_the_prompt(raw: Raw, cluster: Cluster,
                                                                        direct: dict[str, Any]) -> None:
    import mcp_types as types
    from mcp.shared.exceptions import MCPError

    assert "completions" in (await raw.result("server/discover"))["capabilities"]
    prompt = {"type": "ref/prompt", "name": "alpha__everything__completable-prompt"}
    got = await raw.result("completion/complete", {"ref": prompt, "argument": {"name": "department", "value": ""}})
    assert direct["departments"]["values"] and got["completion"] == direct["departments"]
    named = await raw.result("completion/complete", {"ref": prompt, "argument": {"name": "name", "value": ""},
                                                     "context": {"arguments": {"department": "Engineering"}}})
    assert direct["names"]["values"] and named["completion"] == direct["names"]  # the context reached the server
    unknown = await raw.post("completion/complete", {"ref": {"type": "ref/prompt", "name": "beta__x__y"},
                                                     "argument": {"name": "a", "value": ""}})
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == -32602
    reader = Raw(raw.http, raw.url, cluster.read_token, raw.capabilities)  # completing runs on the device
    barred = await reader.post("completion/complete", {"ref": prompt, "argument": {"name": "department", "value": ""}})
    assert barred.status_code == 400 and "'execute' scope" in barred.json()["error"]["message"]

    async with mcp_client(raw.url, raw.token) as client:  # the handshake era, a resource template's argument
        [template] = [t.uri_template for t in (await client.list_resource_templates()).resource_templates
                      if "dynamic%2Ftext" in t.uri_template]
        ids = await client.complete(types.ResourceTemplateReference(type="ref/resource", uri=template),
                                    {"name": "resourceId", "value": "1"})
        assert ids.completion.model_dump(mode="json", by_alias=True, exclude_none=True) == direct["ids"]
        with pytest.raises(MCPError) as refused:
            await client.complete(types.ResourceTemplateReference(type="ref/resource", uri="tether://beta/x/{y}"),
                                  {"name": "y", "value": ""})
        assert refused.value.error.code == -32602


TASKS = {"elicitation": {"form": {}}, "extensions": {"io.modelcontextprotocol/tasks": {}}}


async def settled(raw: Raw, task_id: str, *until: str) -> dict[str, Any]:
    """`tasks/get` at the task's own poll interval until its status is one of `until` (bounded)."""
    async with asyncio.timeout(60):
        while True:
            task = await raw.result("tasks/get", {"taskId": task_id})
            if task["status"] in until:
                return task
            await asyncio.sleep(task["pollIntervalMs"] / 1000)  # the extension's polling, as it asks


async def test_an_approval_and_a_cancel_through_the_tasks_extension(raw: Raw, cluster: Cluster,
                                                                     tmp_path: Path) -> None:
    found = await raw.result("server/discover")
    assert "io.modelcontextprotocol/tasks" in found["capabilities"]["extensions"]
    raw.capabilities = TASKS
    call = {"name": "alpha__shell.run", "arguments": {"cmd": "nproc", "argv": ["--all"], "cwd": str(tmp_path)}}
    handle = await raw.result("tools/call", call)  # it asks at once: a task holding the question
    assert handle["resultType"] == "task" and handle["status"] == "input_required", handle
    task = await raw.result("tasks/get", {"taskId": handle["taskId"]})
    [(key, question)] = task["inputRequests"].items()
    assert question["method"] == "elicitation/create" and "`nproc --all`" in question["params"]["message"]
    await raw.result("tasks/update", {"taskId": handle["taskId"], "inputResponses": {
        key: {"action": "accept", "content": {"decision": "approve once"}}}})
    done = await settled(raw, handle["taskId"], "completed", "failed", "cancelled")
    assert done["status"] == "completed" and done["result"]["structuredContent"]["exitCode"] == 0, done

    # an external server's own question (server-everything's form) reaches the client through the task too
    handle = await raw.result("tools/call", {"name": "alpha__trigger-elicitation-request", "arguments": {}})
    assert handle["resultType"] == "task" and handle["status"] == "input_required", handle
    [(key, question)] = (await raw.result("tasks/get", {"taskId": handle["taskId"]}))["inputRequests"].items()
    assert question["params"]["message"].startswith("everything on device alpha asks: ")
    await raw.result("tasks/update", {"taskId": handle["taskId"], "inputResponses": {key: {"action": "decline"}}})
    told = await settled(raw, handle["taskId"], "completed", "failed", "cancelled")
    assert told["status"] == "completed" and "decline" in json.dumps(told["result"]).lower(), told

    # another token does not see it, and a client without the extension may not ask
    other = Raw(raw.http, raw.url, cluster.read_token, TASKS)
    assert (await other.post("tasks/get", {"taskId": handle["taskId"]})).json()["error"]["code"] == -32602
    raw.capabilities = {}
    assert (await raw.post("tasks/get", {"taskId": handle["taskId"]})).json()["error"]["code"] == -32021
    raw.capabilities = TASKS

    # a long call (the policy allows sleep) becomes a task, working; cancelled, its process on the device dies
    sleeper = {"name": "alpha__shell.run", "arguments": {"cmd": "sleep", "argv": ["301"], "cwd": str(tmp_path)}}
    handle = await raw.result("tools/call", sleeper)
    assert handle["resultType"] == "task" and handle["status"] == "working", handle
    pid: int = cluster.alpha_pid  # type: ignore[attr-defined]
    process = await asyncio.to_thread(wait_for, lambda: _sleeping(pid), "sleep 301 on the device", 30)
    assert (await raw.result("tasks/get", {"taskId": handle["taskId"]}))["status"] == "working"
    await raw.result("tasks/cancel", {"taskId": handle["taskId"]})
    assert (await settled(raw, handle["taskId"], "completed", "failed", "cancelled"))["status"] == "cancelled"
    await asyncio.to_thread(process.wait, 15)  # psutil.TimeoutExpired if it was left running


def _sleeping(device_pid: int, seconds: str = "301") -> Any:
    import psutil

    try:
        return next((p for p in psutil.Process(device_pid).children(recursive=True)
                     if p.name() == "sleep" and seconds in p.cmdline()), None)
    except psutil.NoSuchProcess:
        return None


async def test_closing_the_request_cancels_the_call_on_the_device(raw: Raw, cluster: Cluster, tmp_path: Path) -> None:
    """2026-07-28 has no notifications/cancelled over HTTP: a client that closes its request's stream cancels it."""
    call = asyncio.create_task(raw.post("tools/call", {"name": "alpha__shell.run", "arguments": {
        "cmd": "sleep", "argv": ["302"], "cwd": str(tmp_path)}}))
    pid: int = cluster.alpha_pid  # type: ignore[attr-defined]
    process = await asyncio.to_thread(wait_for, lambda: _sleeping(pid, "302"), "sleep 302 on the device", 30)
    call.cancel()  # httpx closes the connection
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.to_thread(process.wait, 15)  # psutil.TimeoutExpired if it was left running
