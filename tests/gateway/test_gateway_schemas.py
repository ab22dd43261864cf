"""Every tool `/mcp` lists has an input schema every major MCP client accepts: `type: object` at the top and
no `anyOf`/`oneOf`/`allOf`/`not`/`enum`/`const` there (Anthropic's API refuses top-level combinators, so
Claude-based clients drop such a tool or fail). Checked with the official `mcp` SDK client against the whole
agent server (the gateway's own tools, the agent's task tools, a real device's built-in tools) and a device
reporting external MCP servers' tools (`@modelcontextprotocol/server-everything`'s own, and made-up ones whose
schemas have top-level combinators: flattened, see `client_safe_schema` in
server/mcp/tools/translate.py and docs/gateway.md))."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.kits.aip import FakeDevice
from tests.kits.gateway import mcp_client
from tests.kits.task import AgentServer
from tether.protocol.models import ToolInfo
from tether.protocol.profile import DeviceProfile
from tether.server.mcp.tools.translate import TOP_LEVEL_REFUSED, client_safe_schema
from tether.tools.policy.model import default_policy

PICK = ToolInfo(name="pick", namespace="mcp.ext", tool_type="action", description="by id or by name",
                input_schema={"type": "object", "properties": {"limit": {"type": "integer"}},
                              "oneOf": [{"properties": {"id": {"type": "integer"}}, "required": ["id"]},
                                        {"properties": {"name": {"type": "string"}}, "required": ["name"]}]})
BOTH = ToolInfo(name="both", namespace="mcp.ext", tool_type="action", description="all of",
                input_schema={"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                                        {"properties": {"b": {"type": "number"}}, "required": ["b"]}]})
NOT_OBJECT = ToolInfo(name="odd", namespace="mcp.ext", tool_type="action", description="no type, a not",
                      input_schema={"properties": {"x": {"type": "string"}}, "not": {"required": ["y"]}})
EVERYTHING = Path(__file__).resolve().parents[2] / ".tether-test-node/node_modules/.bin/mcp-server-everything"
EMPTY = ToolInfo(name="bare", namespace="mcp.ext", tool_type="data_collection", description="empty schema",
                 input_schema={})


async def everything_tools() -> list[ToolInfo]:
    """The tools a device reports for `@modelcontextprotocol/server-everything` (npm), a server nobody here wrote:
    its own schemas, as the device's MCP client passes them on."""
    if shutil.which("node") is None or not EVERYTHING.exists():
        pytest.fail(f"{EVERYTHING} (or node) is missing; install it with: npm install --prefix .tether-test-node "
                    "@modelcontextprotocol/server-everything")
    from tether.device.mcp.client.manager import MCPServerManager
    from tether.tools.context import ToolContext
    from tether.tools.policy.model import Policy

    manager = MCPServerManager(context=ToolContext(policy=Policy()))
    try:
        server = manager.create_or_get_server({"namespace": "everything", "server_type": "stdio",
                                               "command": str(EVERYTHING), "args": ["stdio"], "startup_timeout": 30})
        assert await manager.start_servers([server]) == {}
        return list(await server.list_tools("action"))
    finally:
        await manager.aclose()


def accepted(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "object" and not any(key in schema for key in TOP_LEVEL_REFUSED)


async def test_every_listed_tool_has_a_top_level_object_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other_temp = tmp_path / "device-temp"
    other_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(other_temp))
    root = tmp_path / "alpha"
    root.mkdir()
    policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
    passed_on = await everything_tools()
    async with AgentServer(tmp_path) as agent:
        await agent.add_device("alpha", policy, tmp_path / "state-alpha")
        secret = agent.store.tokens.create("device", "beta")[1]
        external = FakeDevice(f"ws://127.0.0.1:{agent.port}/aip", secret, name="beta",
                              profile=DeviceProfile(tools=[PICK, BOTH, NOT_OBJECT, EMPTY, *passed_on]))
        ack = await external.register()
        assert ack.status.value == "ok", ack
        try:
            async with mcp_client(f"http://127.0.0.1:{agent.port}/mcp", agent.token) as client:
                listed = {t.name: t for t in (await client.list_tools()).tools}
                refused = await client.call_tool("run_task", {})
                bad_plan = await client.call_tool("run_task", {"plan": []})
        finally:
            await external.close()
    builtin = [name for name in listed if "alpha" in (listed[name].description or "")]
    outside = [name for name in listed if "beta" in (listed[name].description or "")]
    assert {"run_task", "list_devices", "run_on_fleet"} <= set(listed) and len(builtin) > 5
    assert len(outside) == 4 + len(passed_on) and len(passed_on) > 5 and "beta__echo" in outside
    wrong = {name: tool.input_schema for name, tool in listed.items() if not accepted(tool.input_schema)}
    assert not wrong, wrong
    run = listed["run_task"].input_schema
    assert {"request", "plan"} <= set(run["properties"]) and "at least one" in run["properties"]["plan"]["description"]
    # the alternatives survive as optional properties and a description, the server keeps the exact check
    pick = next(listed[n].input_schema for n in outside if "pick" in n)
    assert set(pick["properties"]) == {"limit", "id", "name"} and "required" not in pick
    assert '"oneOf"' in pick["description"]
    both = next(listed[n].input_schema for n in outside if "both" in n)
    assert both["required"] == ["a", "b"] and set(both["properties"]) == {"a", "b"}
    assert refused.is_error and "give `request`" in refused.content[0].text and "`plan`" in refused.content[0].text
    assert bad_plan.is_error and "plan" in bad_plan.content[0].text


def test_a_clean_schema_is_passed_on_as_it_is() -> None:
    schema = {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}
    assert client_safe_schema(schema) is schema
    assert client_safe_schema({"type": "object", "enum": [{}]}) == {"type": "object", "properties": {},
                                                                   "description": 'Arguments must also satisfy: '
                                                                                  '{"enum":[{}]}'}
