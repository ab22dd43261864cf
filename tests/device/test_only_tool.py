"""A device made for one tool (`only_tool`: a one-off `tether exec`) starts only the built-in sets that can hold it,
and resolves every command for that tool as a device with every set started does: the same tool, the same
collisions, the same errors (issue 33 item 4)."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from tether.device.config import parse_device_config
from tether.device.local import LocalDevice, open_local_device
from tether.protocol.models import Command, ResultStatus

# shell, files, system (built in, in that order), then files again under the namespace f2: a collision
F2 = {"namespace": "f2", "server_type": "local", "toolset": "files"}
CONFIG = {"device": {"builtin": ["shell", "files", "system"]}, "mcp": {"default": {"default": {"action": [F2]}}}}


async def _device(stack: AsyncExitStack, tmp_path: Path, only_tool: str | None) -> LocalDevice:
    return await stack.enter_async_context(open_local_device(
        parse_device_config(CONFIG), state_dir=tmp_path / f"state-{only_tool}", sandbox=False, only_tool=only_tool))


def _resolved(device: LocalDevice, command: Command) -> str:
    computer = device.computer_manager.get_existing(None)
    assert computer is not None
    try:
        return computer.command2tool(command).tool_key
    except ValueError as exc:
        return f"error: {exc}"


@pytest.mark.parametrize(("tool", "started"), [
    ("get_system_info", {"system"}), ("read_file", {"files", "f2"}), ("f2/read_file", {"f2"}),
    ("shell.run", {"shell"}), ("nosuch", {"shell", "files", "system", "f2"}),
    ("list_tools", {"shell", "files", "system", "f2"})])
async def test_only_the_sets_that_can_hold_the_tool_start_and_it_resolves_as_with_all(
        tmp_path: Path, tool: str, started: set[str]) -> None:
    async with AsyncExitStack() as stack:
        full = await _device(stack, tmp_path, None)
        one = await _device(stack, tmp_path, tool)
        computer = await one.computer_manager.get_or_create(None)
        assert {info.namespace for info in computer.tool_infos()} == started
        whole = await full.computer_manager.get_or_create(None)
        if started >= {"files", "f2"}:
            assert computer.collisions == whole.collisions != []
        for tool_type in (None, "action", "data_collection"):
            command = Command(tool_name=tool, tool_type=tool_type)
            assert _resolved(one, command) == _resolved(full, command), tool_type


async def test_the_tool_runs_and_the_session_ends_on_a_device_made_for_it(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        one = await _device(stack, tmp_path, "get_system_info")
        dispatcher = one.dispatcher(session_id="s1")
        [result, ended] = await dispatcher.execute_commands(
            [Command(tool_name="get_system_info", parameters={"info_type": "os"}), Command(tool_name="end_session")],
            timeout=30)
        assert result.status is ResultStatus.SUCCESS and result.namespace == "system", result
        assert ended.status is ResultStatus.SUCCESS and ended.result == {"session_id": "s1", "tmp_removed": False}
