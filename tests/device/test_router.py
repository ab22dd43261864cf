"""Computer, ComputerManager, CommandRouter, DeviceClient and LocalCommandDispatcher together."""

from __future__ import annotations

import asyncio
from typing import Annotated

import pytest
from pydantic import Field

from tether.device.client import DeviceClient
from tether.device.computer.manager import ComputerManager
from tether.device.config import parse_device_config
from tether.device.local_dispatcher import LocalCommandDispatcher
from tether.device.mcp.client.manager import MCPServerManager
from tether.device.mcp.config.server_config import MCPServerConfig
from tether.protocol.messages import ServerMessage, ServerMessageType
from tether.protocol.models import TOOL_TYPES, Command, ResultStatus
from tether.tools.context import ToolContext
from tether.tools.policy.model import Policy
from tether.tools.runtime import ToolSet, tool


@tool("echo", tool_type="action")
async def echo(text: Annotated[str, Field(description="what to say")], times: int = 1) -> dict:
    """Repeat text."""
    return {"text": text * times}


@tool("peek", tool_type="data_collection")
async def peek(ctx) -> dict:
    """Report the call's context."""
    return {"session": ctx.session_id, "call_id": ctx.call_id, "approved_by": ctx.approved_by}


@tool("boom", tool_type="action")
async def boom() -> None:
    """Always fails."""
    raise RuntimeError("kaboom")


@tool("wait", tool_type="action")
async def wait(started: str = "") -> dict:
    """Block until cancelled."""
    await asyncio.Event().wait()
    return {}


@tool("echo", tool_type="action")
async def echo2(text: str) -> dict:
    """Another echo, in a second namespace."""
    return {"other": text}


def toolsets() -> dict:
    return {
        "alpha": lambda: ToolSet("alpha", [echo, peek, boom, wait]),
        "beta": lambda: ToolSet("beta", [echo2]),
    }


CONFIG = {
    "device": {"builtin": []},
    "mcp": {
        "default": {
            "default": {"action": [{"namespace": "alpha", "toolset": "alpha"},
                                   {"namespace": "beta", "toolset": "beta"}]},
            "beta_first": {"action": [{"namespace": "beta", "toolset": "beta"},
                                      {"namespace": "alpha", "toolset": "alpha"}]},
        },
        "HostAgent": {"default": {"action": [{"namespace": "alpha", "toolset": "alpha"}]}},
    },
}


@pytest.fixture
async def client():
    servers = MCPServerManager(toolsets=toolsets())
    manager = ComputerManager(parse_device_config(CONFIG), servers, context=ToolContext(policy=Policy()))
    yield DeviceClient(servers, manager, client_id="test")
    await servers.aclose()


async def run(client: DeviceClient, *commands: Command, early_exit: bool = True, **ctx):
    for key, value in ctx.items():
        setattr(client, key, value)
    return await client.execute_actions(list(commands), early_exit=early_exit)


async def test_round_trip_and_call_ids(client):
    cmd = Command(tool_name="echo", parameters={"text": "ab", "times": 2})
    [result] = await run(client, cmd)
    assert result.status is ResultStatus.SUCCESS
    assert result.result == {"text": "abab"}
    assert result.namespace == "alpha"
    assert result.call_id == cmd.call_id and cmd.call_id


async def test_unknown_agent_fails_each_command_with_the_reason(client):
    commands = [Command(tool_name="echo", parameters={"text": t}) for t in "ab"]
    seen = []
    results = await client.command_router.execute("no-such-agent", None, None, commands, on_result=seen.append)
    assert [r.status for r in results] == [ResultStatus.FAILURE] * 2
    assert all("unknown agent 'no-such-agent'" in (r.error or "") for r in results)
    assert seen == results  # a connection relies on on_result to deliver them (not "no result")
    assert [r.call_id for r in results] == [c.call_id for c in commands]


async def test_unknown_tool_names_it(client):
    [result] = await run(client, Command(tool_name="nope"))
    assert result.status is ResultStatus.FAILURE
    assert "unknown tool 'nope'" in result.error


async def test_wrong_tool_type_hints_the_other(client):
    [result] = await run(client, Command(tool_name="echo", tool_type="data_collection", parameters={"text": "x"}))
    assert result.status is ResultStatus.FAILURE
    assert "exists as a action tool" in result.error


async def test_missing_and_wrong_arguments_name_the_argument(client):
    missing, wrong = await run(client, Command(tool_name="echo", parameters={}),
                               Command(tool_name="echo", parameters={"text": "x", "times": "3"}),
                               early_exit=False)
    assert missing.status is ResultStatus.FAILURE and "missing required argument 'text'" in missing.error
    assert wrong.status is ResultStatus.FAILURE and "argument 'times'" in wrong.error
    assert "echo" in wrong.error


async def test_unknown_argument_is_refused(client):
    [result] = await run(client, Command(tool_name="echo", parameters={"text": "x", "loud": True}))
    assert result.status is ResultStatus.FAILURE and "unknown argument 'loud'" in result.error


async def test_tool_crash_becomes_failure(client):
    [result] = await run(client, Command(tool_name="boom"))
    assert result.status is ResultStatus.FAILURE
    assert "kaboom" in result.error


async def test_early_exit_skips_the_rest(client):
    cmds = [Command(tool_name="echo", parameters={"text": "1"}), Command(tool_name="boom"),
            Command(tool_name="echo", parameters={"text": "3"}), Command(tool_name="echo", parameters={"text": "4"})]
    results = await run(client, *cmds)
    assert [r.status for r in results] == [ResultStatus.SUCCESS, ResultStatus.FAILURE,
                                           ResultStatus.SKIPPED, ResultStatus.SKIPPED]
    assert [r.call_id for r in results] == [c.call_id for c in cmds]
    assert "boom" in results[2].error


async def test_without_early_exit_everything_runs(client):
    results = await run(client, Command(tool_name="boom"), Command(tool_name="echo", parameters={"text": "x"}),
                        early_exit=False)
    assert [r.status for r in results] == [ResultStatus.FAILURE, ResultStatus.SUCCESS]


async def test_unknown_agent_fails_every_command(client):
    cmds = [Command(tool_name="echo", parameters={"text": "x"}), Command(tool_name="echo", parameters={"text": "y"})]
    results = await run(client, *cmds, agent_name="GhostAgent")
    assert all(r.status is ResultStatus.FAILURE for r in results)
    assert "unknown agent 'GhostAgent'" in results[0].error


async def test_unknown_root_falls_back_to_default(client):
    [result] = await run(client, Command(tool_name="echo", parameters={"text": "x"}),
                         agent_name="HostAgent", root_name="no_such_root")
    assert result.status is ResultStatus.SUCCESS
    assert "HostAgent::::default" in client.computer_manager.computers


async def test_collisions_are_deterministic_and_reported(client):
    computer = await client.computer_manager.get_or_create("default", None, "default")
    assert computer.collisions == [{"tool": "echo", "tool_type": "action", "kept": "alpha",
                                    "shadowed": "beta", "use": "beta/echo"}]
    [plain, qualified] = await run(client, Command(tool_name="echo", parameters={"text": "x"}),
                                   Command(tool_name="beta/echo", parameters={"text": "x"}))
    assert plain.result == {"text": "x"} and qualified.result == {"other": "x"}
    [flipped] = await run(client, Command(tool_name="echo", parameters={"text": "x"}), root_name="beta_first")
    assert flipped.result == {"other": "x"}


async def test_meta_list_tools_filters(client):
    [all_tools, only_dc] = await run(
        client, Command(tool_name="list_tools", tool_type="action"),
        Command(tool_name="list_tools", tool_type="action", parameters={"tool_type": "data_collection"}))
    names = {(t["namespace"], t["name"]) for t in all_tools.result}
    assert ("alpha", "echo") in names and ("beta", "echo") in names
    assert not any(t["meta"] for t in all_tools.result)
    assert {t["name"] for t in only_dc.result} == {"peek"}
    [with_meta] = await run(client, Command(tool_name="list_tools", parameters={"remove_meta": False,
                                                                                "namespace": "meta"}))
    assert {t["tool_type"] for t in with_meta.result} == {"data_collection", "action"}


async def test_registration_lists_no_meta_tool_and_builds_none_of_their_schemas(client):
    """What a device registers with (`tool_infos()`: no meta tools) leaves their schemas unbuilt (issue 33);
    listing them builds each, and calling one works as before."""
    computer = await client.computer_manager.get_or_create(None)
    metas = computer._meta_tools.values()  # the computer's own: list_tools, undo_session, the resources' tools
    assert {i.name for i in computer.tool_infos()} == {"echo", "peek", "boom", "wait"}
    assert metas and not any("_schemas" in vars(spec) for spec in metas)
    listed = [i for i in computer.tool_infos(remove_meta=False) if i.meta]
    assert {(i.name, i.tool_type) for i in listed} == {(s.name, t) for s in metas for t in TOOL_TYPES}
    assert all("_schemas" in vars(spec) for spec in metas)
    undo = next(i for i in listed if i.name == "undo_session")
    assert undo.namespace == "meta" and undo.input_schema["required"] == ["session_id"]
    [result] = await run(client, Command(tool_name="list_tools"))
    assert result.status is ResultStatus.SUCCESS and {t["name"] for t in result.result} == {"echo", "peek", "boom",
                                                                                             "wait"}


async def test_context_reaches_the_tool(client):
    cmd = Command(tool_name="peek", approved_by="alice")
    [result] = await run(client, cmd, session_id="s-42")
    assert result.result == {"session": "s-42", "call_id": cmd.call_id, "approved_by": "alice"}


async def test_add_and_delete_server_at_run_time(client):
    computer = await client.computer_manager.get_or_create("HostAgent")
    [before] = await run(client, Command(tool_name="beta/echo", parameters={"text": "x"}), agent_name="HostAgent")
    assert before.status is ResultStatus.FAILURE
    server = client.mcp_server_manager.create_or_get_server(MCPServerConfig(namespace="beta", toolset="beta"))
    await computer.add_server("beta", server, "action")
    [after] = await run(client, Command(tool_name="beta/echo", parameters={"text": "x"}), agent_name="HostAgent")
    assert after.result == {"other": "x"}
    await computer.delete_server("alpha", "action")
    [now] = await run(client, Command(tool_name="echo", parameters={"text": "x"}), agent_name="HostAgent")
    assert now.result == {"other": "x"}, "the shadowed echo takes over the plain name"
    with pytest.raises(ValueError):
        await computer.delete_server("alpha", "action")


async def test_session_properties_reject_wrong_types(client):
    for name in ("session_id", "agent_name", "process_name", "root_name"):
        with pytest.raises(ValueError):
            setattr(client, name, 123)
        setattr(client, name, "ok")
        assert getattr(client, name) == "ok"
    client.reset()
    assert client.session_id is None and client.agent_name is None
    assert client.computer_manager.computers == {}


async def test_execute_step_adopts_the_message_context(client):
    msg = ServerMessage(type=ServerMessageType.COMMAND, session_id="sess", agent_name="HostAgent",
                        root_name="whatever", actions=[Command(tool_name="peek")])
    [result] = await client.execute_step(msg)
    assert result.result["session"] == "sess"
    assert client.agent_name == "HostAgent"


async def test_local_dispatcher_timeout_keeps_finished_results(client):
    dispatcher = LocalCommandDispatcher(client, session_id="d1")
    cmds = [Command(tool_name="echo", parameters={"text": "done"}), Command(tool_name="wait"),
            Command(tool_name="echo", parameters={"text": "never"})]
    results = await dispatcher.execute_commands(cmds, timeout=0.3)
    assert [r.status for r in results] == [ResultStatus.SUCCESS, ResultStatus.FAILURE, ResultStatus.FAILURE]
    assert results[0].result == {"text": "done"}
    assert "timed out" in results[1].error
    assert [r.call_id for r in results] == [c.call_id for c in cmds]


async def test_generate_error_results_matches_commands(client):
    dispatcher = LocalCommandDispatcher(client)
    cmds = [Command(tool_name="a"), Command(tool_name="b")]
    results = dispatcher.generate_error_results(cmds, RuntimeError("link down"))
    assert [r.call_id for r in results] == [c.call_id for c in cmds]
    assert all(r.status is ResultStatus.FAILURE and "link down" in r.error for r in results)


async def test_concurrent_get_or_create_builds_once(client):
    manager = client.computer_manager
    first, second = await asyncio.gather(manager.get_or_create(None), manager.get_or_create(None))
    assert first is second


async def test_optional_tool_set_that_cannot_start_says_what_to_install(tmp_path, monkeypatch):
    from tether.device.local import build_device

    monkeypatch.delenv("DISPLAY", raising=False)  # no display: the desktop set cannot start
    device = build_device(parse_device_config({"device": {"builtin": ["shell", "desktop"]}}),
                          policy=Policy(), state_dir=tmp_path)
    try:
        computer = await device.computer_manager.get_or_create(None)
        assert "desktop" in computer.startup_errors
        assert not [i for i in computer.tool_infos() if i.namespace == "desktop"]
        [result] = await device.client.execute_actions([Command(tool_name="ui.findAndClick",
                                                                parameters={"label": "OK"})])
        assert result.status is ResultStatus.FAILURE
        assert "not available on this device" in result.error
        assert "desktop" in result.error and ("pip install" in result.error or "DISPLAY" in result.error)
    finally:
        await device.aclose()
