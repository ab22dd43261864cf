"""Third-party MCP servers behind the whole device path: config → Computer → CommandRouter."""

from __future__ import annotations

import sys

from tether.device.config import parse_device_config
from tether.device.local import build_device
from tether.protocol.models import Command, ResultStatus
from tether.tools.policy.model import Policy
from tether.tools.toolsets.builtin import OPTIONAL_SETS


async def test_time_and_filesystem_servers_through_the_router(node_mcp_bin, tmp_path):
    root = tmp_path / "fsroot"
    root.mkdir()
    config = parse_device_config({"mcpServers": {
        "time": {"command": sys.executable, "args": ["-m", "mcp_server_time"], "toolType": "data_collection"},
        "fs": {"command": str(node_mcp_bin), "args": [str(root)]},
    }})
    device = build_device(config, policy=Policy(), state_dir=tmp_path / "state")
    try:
        computer = await device.computer_manager.get_or_create(None)
        assert set(computer.startup_errors) <= set(OPTIONAL_SETS)  # desktop needs a display
        infos = {(i.namespace, i.name, i.tool_type) for i in computer.tool_infos()}
        assert ("time", "get_current_time", "data_collection") in infos
        assert ("fs", "write_file", "action") in infos
        assert ("fs", "read_text_file", "data_collection") in infos  # annotated readOnlyHint: true
        # both the built-in files set and the Node server offer write_file/read_file: built-ins come
        # first in the config, so the plain name stays ours and the Node one is fs/write_file
        assert {"tool": "write_file", "tool_type": "action", "kept": "files", "shadowed": "fs",
                "use": "fs/write_file"} in computer.collisions

        target = root / "note.txt"
        listed, time_now, wrote, read, bad_tz = await device.client.execute_actions([
            Command(tool_name="list_tools", parameters={"namespace": "fs"}),
            Command(tool_name="get_current_time", parameters={"timezone": "UTC"}),
            Command(tool_name="fs/write_file", tool_type="action",  # destructiveHint: true, so approved
                    parameters={"path": str(target), "content": "from node"}, approved_by="tester"),
            Command(tool_name="fs/read_text_file", tool_type="data_collection", parameters={"path": str(target)}),
            Command(tool_name="get_current_time", parameters={"timezone": "Mars/Olympus"}),
        ], early_exit=False)
        assert listed.status is ResultStatus.SUCCESS and any(t["name"] == "read_text_file" for t in listed.result)
        assert time_now.status is ResultStatus.SUCCESS and time_now.namespace == "time"
        assert "UTC" in str(time_now.result)
        assert wrote.status is ResultStatus.SUCCESS, wrote.error
        assert target.read_text() == "from node"
        assert read.status is ResultStatus.SUCCESS and "from node" in str(read.result)
        assert bad_tz.status is ResultStatus.FAILURE and bad_tz.error
    finally:
        await device.aclose()
