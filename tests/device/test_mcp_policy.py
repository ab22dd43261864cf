"""External MCP tools under the device's policy: annotations, per-server tool rules, sandboxed servers.

Real servers only: `tests/servers/annotated.py` (the official SDK, one tool per kind of annotation,
touching real files) and `mcp-server-time` from PyPI, started as stdio processes, through the
server objects and through the whole device path (config file → Computer → CommandRouter).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mcp_types
import pytest

from tether.device.config import load_device_config, parse_device_config
from tether.device.local import build_device
from tether.device.mcp.client.manager import BaseMCPServer, MCPServerManager
from tether.device.mcp.client.servers import SessionServer
from tether.device.mcp.config.server_config import MCPServerConfig
from tether.device.probe import collect_profile
from tether.protocol.models import Command, Result, ResultStatus
from tether.sandbox import SandboxSpec, detect
from tether.tools.context import ToolContext
from tether.tools.policy.model import Policy

ANNOTATED = str(Path(__file__).parent.parent / "servers" / "annotated.py")
NEEDS_APPROVAL = {"needs_approval": True, "rule": "approval.mcp_destructive"}


def annotated(namespace: str = "ann", **extra: Any) -> dict[str, Any]:
    return {"namespace": namespace, "server_type": "stdio", "command": sys.executable, "args": [ANNOTATED],
            "startup_timeout": 20, **extra}


@pytest.fixture
async def manager() -> AsyncIterator[MCPServerManager]:
    mgr = MCPServerManager()
    yield mgr
    await mgr.aclose()


async def started(mgr: MCPServerManager, config: dict[str, Any]) -> BaseMCPServer:
    server = mgr.create_or_get_server(config)
    assert await mgr.start_servers([server]) == {}
    return server


async def call(server: BaseMCPServer, name: str, args: dict[str, Any] | None = None, *,
               approved_by: str | None = None) -> Result:
    ctx = ToolContext(policy=Policy(), call_id="c1", approved_by=approved_by)
    return await server.call_tool(name, args or {}, ctx=ctx, timeout=20)


# --- annotations --------------------------------------------------------------------------------

async def test_read_only_annotation_makes_a_tool_data_collection(manager: MCPServerManager) -> None:
    server = await started(manager, annotated())
    types = {t.name: t.tool_type for t in await server.list_tools("action")}
    assert types == {"read_text": "data_collection", "write_text": "action", "delete": "action",
                     "append": "action", "plain": "action", "contradictory": "data_collection",
                     "whoami": "data_collection"}
    # a third-party server: mcp-server-time marks both its tools readOnlyHint, configured as action here
    time = await started(manager, {"namespace": "time", "server_type": "stdio", "command": sys.executable,
                                   "args": ["-m", "mcp_server_time"]})
    assert {t.tool_type for t in await time.list_tools("action")} == {"data_collection"}
    assert (await call(time, "get_current_time", {"timezone": "UTC"})).ok


async def test_destructive_tool_needs_approval_then_runs(manager: MCPServerManager, tmp_path: Path) -> None:
    server = await started(manager, annotated())
    target = tmp_path / "note.txt"
    target.write_text("before")

    held = await call(server, "write_text", {"path": str(target), "text": "after"})
    assert held.status is ResultStatus.FAILURE and held.result == NEEDS_APPROVAL
    assert held.error.startswith("write_text: needs approval (policy rule 'approval.mcp_destructive')")
    assert held.namespace == "ann" and held.call_id == "c1"
    assert target.read_text() == "before"  # nothing reached the server

    ran = await call(server, "write_text", {"path": str(target), "text": "after"}, approved_by="alice")
    assert ran.ok, ran.error
    assert target.read_text() == "after"

    # destructiveHint: false, no annotations (the default "hinted" rule) and read-only run at once
    assert (await call(server, "append", {"path": str(target), "text": "!"})).ok
    assert (await call(server, "plain", {"text": "x"})).result["structured"] == "X"
    assert (await call(server, "read_text", {"path": str(target)})).result["structured"] == "after!"
    assert (await call(server, "contradictory")).ok  # readOnlyHint wins over destructiveHint

    # a tool called freely before is held once a new listing marks it destructive: decided again per listing
    assert isinstance(server, SessionServer)
    server._note_tools([mcp_types.Tool(name="plain", input_schema={"type": "object"},
                                       annotations=mcp_types.ToolAnnotations(destructive_hint=True))])
    assert (await call(server, "plain", {"text": "x"})).result == NEEDS_APPROVAL


async def test_strict_mode_holds_tools_that_declare_nothing(manager: MCPServerManager, tmp_path: Path) -> None:
    server = await started(manager, annotated(approve_destructive="strict"))
    assert (await call(server, "plain", {"text": "x"})).result == NEEDS_APPROVAL
    assert (await call(server, "plain", {"text": "x"}, approved_by="alice")).result["structured"] == "X"
    assert (await call(server, "append", {"path": str(tmp_path / "a"), "text": "x"})).ok  # destructiveHint: false
    assert (await call(server, "read_text", {"path": str(tmp_path / "a")})).result["structured"] == "x"
    assert (await call(server, "delete", {"path": str(tmp_path / "a")})).result == NEEDS_APPROVAL


# --- per-server rules ---------------------------------------------------------------------------

async def test_allow_deny_approve_and_auto_approve(manager: MCPServerManager, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")

    allow = await started(manager, annotated("allow", allow_tools=["read_text", "plain"]))
    assert {t.name for t in await allow.list_tools("action")} == {"read_text", "plain"}
    refused = await call(allow, "delete", {"path": str(victim)}, approved_by="alice")  # approval lifts no denial
    assert refused.result == {"denied": True, "rule": "mcp.allow_tools"}
    assert "denied by policy rule 'mcp.allow_tools'" in refused.error and "'delete'" in refused.error
    assert victim.exists()

    deny = await started(manager, annotated("deny", deny_tools=["delete", "whoami"]))
    assert {t.name for t in await deny.list_tools("action")} == {
        "read_text", "write_text", "append", "plain", "contradictory"}
    refused = await call(deny, "delete", {"path": str(victim)}, approved_by="alice")
    assert refused.result == {"denied": True, "rule": "mcp.deny_tools"} and victim.exists()

    approve = await started(manager, annotated("approve", approve_tools=["read_text"]))
    held = await call(approve, "read_text", {"path": str(victim)})  # read-only, yet the config says ask
    assert held.result == {"needs_approval": True, "rule": "approval.mcp_approve_tools"}
    read = await call(approve, "read_text", {"path": str(victim)}, approved_by="alice")
    assert read.result["structured"] == "keep me"

    auto = await started(manager, annotated("auto", autoApprove=["delete"]))
    assert (await call(auto, "write_text", {"path": str(victim), "text": "x"})).result == NEEDS_APPROVAL
    assert (await call(auto, "delete", {"path": str(victim)})).ok  # destructive, but auto-approved
    assert not victim.exists()


def test_rule_config_errors_are_clear() -> None:
    with pytest.raises(ValueError, match=r"\['plain'\] in both 'allow_tools' and 'deny_tools'"):
        MCPServerConfig.model_validate(annotated(allow_tools=["plain"], deny_tools=["plain"]))
    with pytest.raises(ValueError, match="in both 'approve_tools' and 'auto_approve'"):
        MCPServerConfig.model_validate(annotated(approve_tools=["plain"], autoApprove=["plain"]))
    with pytest.raises(ValueError, match="'sandbox' applies to stdio servers only"):
        MCPServerConfig(namespace="web", server_type="http", url="http://127.0.0.1:1/mcp", sandbox=True)
    with pytest.raises(ValueError, match="deny_tools apply to external servers only"):
        MCPServerConfig(namespace="shell", toolset="shell", deny_tools=["run"])
    with pytest.raises(ValueError, match=r"mcpServers.ann: unsupported key\(s\) \['denyTools'\]"):
        parse_device_config({"mcpServers": {"ann": {"command": "x", "denyTools": ["delete"]}}})
    # tether's own config stays strict about unknown top-level keys: a typo must not drop a setting
    with pytest.raises(ValueError, match="globalShortcut"):
        parse_device_config({"device": {"name": "d"}, "globalShortcut": "x", "mcpServers": {}})


async def test_desktop_client_config_file_through_the_device(tmp_path: Path) -> None:
    """A Claude-Desktop/Cline style file as people have it: its own settings, `autoApprove`, and
    tether's keys added to one entry; the router, `list_tools` and the profile obey it."""
    victim = tmp_path / "victim.txt"
    victim.write_text("v")
    note = tmp_path / "note.txt"
    path = tmp_path / "claude_desktop_config.json"
    path.write_text(json.dumps({
        "globalShortcut": "Ctrl+Space",
        "preferences": {"quickEntryShortcut": "off"},
        "mcpServers": {
            "ann": {"command": sys.executable, "args": [ANNOTATED], "env": {"PYTHONUNBUFFERED": "1"},
                    "autoApprove": ["write_text"], "deny_tools": ["whoami"], "approve_tools": ["plain"]},
            "time": {"command": sys.executable, "args": ["-m", "mcp_server_time"], "disabled": False},
        },
    }))
    config = load_device_config(path)
    device = build_device(config, policy=Policy(), state_dir=tmp_path / "state")
    try:
        computer = await device.computer_manager.get_or_create(None)
        assert not {"ann", "time"} & set(computer.startup_errors)
        infos = {(i.namespace, i.name): i.tool_type for i in computer.tool_infos() if i.namespace in ("ann", "time")}
        assert ("ann", "whoami") not in infos
        assert infos[("ann", "read_text")] == "data_collection" and infos[("ann", "delete")] == "action"
        assert infos[("time", "get_current_time")] == "data_collection"

        listed, wrote, deleted, approved_delete, plain, denied, denied_qualified = (
            await device.client.execute_actions([
                Command(tool_name="list_tools", parameters={"namespace": "ann"}),
                Command(tool_name="write_text", parameters={"path": str(note), "text": "auto"}),
                Command(tool_name="delete", parameters={"path": str(victim)}),
                Command(tool_name="delete", parameters={"path": str(victim)}, approved_by="alice"),
                Command(tool_name="plain", parameters={"text": "x"}),
                Command(tool_name="whoami", tool_type="data_collection"),
                Command(tool_name="ann/whoami"),
            ], early_exit=False))
        assert listed.ok and "whoami" not in {t["name"] for t in listed.result}
        assert wrote.ok, wrote.error
        assert note.read_text() == "auto"
        # through the router, a question carries the digest its approval is bound to (tools/policy/approval.py)
        assert deleted.result.pop("approval_digest").startswith("sha256:")
        assert deleted.result == NEEDS_APPROVAL  # the approved one after it deleted the file
        assert approved_delete.ok and not victim.exists()
        assert plain.result.pop("approval_digest").startswith("sha256:")
        assert plain.result == {"needs_approval": True, "rule": "approval.mcp_approve_tools"}
        for refused in (denied, denied_qualified):
            assert refused.status is ResultStatus.FAILURE
            assert "denied by policy rule 'mcp.deny_tools'" in refused.error, refused.error

        profile = await collect_profile(device)
        assert ("ann", "whoami") not in {(t.namespace, t.name) for t in profile.tools}
        assert ("ann", "read_text") in {(t.namespace, t.name) for t in profile.tools}
    finally:
        await device.aclose()


# --- sandboxed stdio servers --------------------------------------------------------------------

def device_sandbox(spec: SandboxSpec) -> SimpleNamespace:
    """What `ToolContext.sandbox` offers a stdio server: the spec, how this machine confines, and what it hides
    beside the spec (`Sandbox.live_hidden`: no sessions' private /tmp here)."""
    info = detect()
    if not info.available:
        pytest.fail(f"no sandbox on this machine: {info.detail}")
    return SimpleNamespace(spec=spec, info=info, live_hidden=lambda: ())


async def test_sandboxed_server_sees_no_secrets_and_writes_only_its_roots(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.fail("bwrap is missing: sudo apt-get install -y bubblewrap")
    root, outside, secret = tmp_path / "root", tmp_path / "outside", tmp_path / "secret"
    for d in (root, outside, secret):
        d.mkdir()
    (secret / "token").write_text("s3cret")
    (outside / "existing.txt").write_text("untouched")
    spec = SandboxSpec.build(write_roots=[str(root)], hidden=[str(secret)])
    mgr = MCPServerManager(context=ToolContext(policy=Policy(), sandbox=device_sandbox(spec)))  # type: ignore[arg-type]
    try:
        server = await started(mgr, annotated("boxed", sandbox=True, autoApprove=["write_text"]))
        assert server.describe().endswith(", sandboxed")

        hidden = await call(server, "read_text", {"path": str(secret / "token")})
        assert hidden.status is ResultStatus.FAILURE and "No such file" in hidden.error, hidden
        readable = await call(server, "read_text", {"path": str(outside / "existing.txt")})
        assert readable.result["structured"] == "untouched"  # the machine is readable, just not writable

        blocked = await call(server, "write_text", {"path": str(outside / "existing.txt"), "text": "pwned"})
        assert blocked.status is ResultStatus.FAILURE and "Read-only file system" in blocked.error, blocked
        blocked_new = await call(server, "write_text", {"path": str(tmp_path / "new.txt"), "text": "x"})
        assert blocked_new.status is ResultStatus.FAILURE and "Read-only file system" in blocked_new.error
        assert (outside / "existing.txt").read_text() == "untouched" and not (tmp_path / "new.txt").exists()

        inside = await call(server, "write_text", {"path": str(root / "out.txt"), "text": "ok"})
        assert inside.ok, inside.error
        assert (root / "out.txt").read_text() == "ok"  # a live bind: the write is real at once

        seen = (await call(server, "whoami")).result["structured"]
        assert seen["processes"] <= 3 and seen["pid"] != os.getpid(), seen  # a private /proc: no device in sight
    finally:
        await mgr.aclose()


async def test_sandbox_true_without_a_sandbox_refuses_to_start(tmp_path: Path) -> None:
    mgr = MCPServerManager(context=ToolContext(policy=Policy(), sandbox=None))
    try:
        errors = await mgr.start_servers([MCPServerConfig.model_validate(annotated("boxed", sandbox=True))])
        assert "boxed" in errors
        assert "says 'sandbox: true' but this device has no sandbox" in errors["boxed"]
        server = mgr.create_or_get_server(annotated("boxed", sandbox=True))
        result = await call(server, "plain", {"text": "x"})
        assert result.status is ResultStatus.FAILURE and "no sandbox" in result.error
    finally:
        await mgr.aclose()


async def test_sandboxed_server_through_the_device_hides_its_state(tmp_path: Path) -> None:
    """With the device's own sandbox (from its policy): the device's state directory and the policy's
    hidden paths are out of the server's sight, and only the write roots are writable."""
    root, secret, state = tmp_path / "root", tmp_path / "secret", tmp_path / "state"
    for d in (root, secret, state):
        d.mkdir()
    (secret / "key").write_text("k")
    (state / "journal.txt").write_text("private")
    config = parse_device_config({"mcpServers": {"boxed": {
        "command": sys.executable, "args": [ANNOTATED], "sandbox": True, "autoApprove": ["write_text"]}}})
    policy = Policy(write_roots=[str(root)], read_roots=[str(tmp_path)], hide_paths=[str(secret)])
    device = build_device(config, policy=policy, state_dir=state)
    if device.context.sandbox is None:
        await device.aclose()
        pytest.fail(f"no sandbox on this machine: {detect().detail}")
    try:
        computer = await device.computer_manager.get_or_create(None)
        assert "boxed" not in computer.startup_errors, computer.startup_errors
        state_read, secret_read, outside, inside = await device.client.execute_actions([
            Command(tool_name="boxed/read_text", parameters={"path": str(state / "journal.txt")}),
            Command(tool_name="boxed/read_text", parameters={"path": str(secret / "key")}),
            Command(tool_name="write_text", parameters={"path": str(tmp_path / "x.txt"), "text": "x"}),
            Command(tool_name="write_text", parameters={"path": str(root / "x.txt"), "text": "x"}),
        ], early_exit=False)
        assert state_read.status is ResultStatus.FAILURE and "No such file" in state_read.error, state_read
        assert secret_read.status is ResultStatus.FAILURE and "No such file" in secret_read.error, secret_read
        assert outside.status is ResultStatus.FAILURE and "Read-only file system" in outside.error, outside
        assert inside.ok, inside.error
        assert (root / "x.txt").read_text() == "x" and not (tmp_path / "x.txt").exists()
    finally:
        await device.aclose()
