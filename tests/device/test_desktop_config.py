"""A desktop MCP client's config file loads as it is (issue 11): its own top-level settings are ignored with
a note, a `disabled` server is not started, `type: http|sse|stdio` with `url` and `headers` reach real
servers (the official SDK's, over streamable HTTP and HTTP+SSE, refusing requests without the header),
the header's token never reaches a log, `type: stdio` takes `env`, and a tool that requires task-augmented
calls (server-everything's simulate-research-query) is not listed."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.device.config import load_device_config, parse_device_config
from tether.device.local import open_local_device
from tether.protocol.models import Command, ResultStatus

HEADED = Path(__file__).parent.parent / "servers" / "headed_http.py"
EVERYTHING = Path(__file__).resolve().parents[2] / ".tether-test-node" / "node_modules" / ".bin" / \
    "mcp-server-everything"
TOKEN = "s3cret-header-token-7f2a"


def _start(*extra: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, str(HEADED), TOKEN, *extra], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed once the socket listens
    assert line.strip().isdigit(), f"headed_http.py did not start: {line!r}"
    return proc, int(line)


@pytest.fixture
def servers() -> Iterator[dict[str, int]]:
    started = [_start(), _start("--sse")]
    try:
        yield {"http": started[0][1], "sse": started[1][1]}
    finally:
        for proc, _ in started:
            proc.kill()
            proc.wait(timeout=30)


def _desktop_file(tmp_path: Path, ports: dict[str, int], **extra: object) -> Path:
    path = tmp_path / "claude_desktop_config.json"
    path.write_text(json.dumps({
        "globalShortcut": "Ctrl+Space", "preferences": {"menuBarEnabled": False},
        "mcpServers": {
            "headed": {"type": "http", "url": f"http://127.0.0.1:{ports['http']}/mcp",
                       "headers": {"X-Test-Token": TOKEN}},
            "old": {"type": "sse", "url": f"http://127.0.0.1:{ports['sse']}/sse", "headers": {"X-Test-Token": TOKEN},
                    "toolType": "data_collection"},
            "off": {"command": str(tmp_path / "never-started"), "disabled": True},
            **extra,
        }}))
    return path


async def test_desktop_file_with_http_and_sse_servers(tmp_path, servers, caplog):
    if not EVERYTHING.exists():
        pytest.fail(f"{EVERYTHING} is missing; install it with: npm install --prefix .tether-test-node "
                    "@modelcontextprotocol/server-everything")
    caplog.set_level(logging.DEBUG)
    path = _desktop_file(tmp_path, servers, bare={"type": "http", "url": f"http://127.0.0.1:{servers['http']}/mcp"},
                         everything={"type": "stdio", "command": str(EVERYTHING), "args": ["stdio"],
                                     "env": {"DESKTOP_CONFIG_MARK": "from-env"}, "cwd": str(tmp_path)})
    config = load_device_config(path)
    assert "ignoring the desktop client's own settings ['globalShortcut', 'preferences']" in caplog.text
    assert "mcpServers.off is disabled: not started" in caplog.text and config.disabled_servers == ["off"]
    async with open_local_device(config, state_dir=tmp_path / "state", sandbox=False) as device:
        computer = await device.computer_manager.get_or_create(None)
        infos = {(i.namespace, i.name) for i in computer.tool_infos()}
        assert ("headed", "whisper") in infos and ("old", "whisper") in infos
        assert ("everything", "echo") in infos
        assert ("everything", "simulate-research-query") not in infos  # requires tasks: not offered
        assert "off" not in {ns for ns, _ in infos} and "off" not in computer.startup_errors
        assert "HTTP 401 (check the entry's 'headers')" in computer.startup_errors["bare"]  # refused, said clearly
        dispatcher = device.dispatcher(session_id="desktop")
        results = await dispatcher.execute_commands(
            [Command(tool_name="whisper", parameters={"text": "HeLLo"}, tool_type="action"),
             Command(tool_name="whisper", parameters={"text": "SSE"}, tool_type="data_collection"),
             Command(tool_name="get-env", parameters={})], timeout=60)
    assert [r.status for r in results] == [ResultStatus.SUCCESS] * 3, results
    assert [r.namespace for r in results] == ["headed", "old", "everything"]
    assert "hello" in json.dumps(results[0].result) and "sse" in json.dumps(results[1].result)
    assert "from-env" in json.dumps(results[2].result)
    assert "not listing simulate-research-query: they require task-augmented calls" in caplog.text
    assert TOKEN not in caplog.text  # headers carry tokens: never logged


def test_desktop_file_through_the_cli(tmp_path, servers):
    path = _desktop_file(tmp_path, servers)
    env = {**os.environ, "TETHER_STATE_DIR": str(tmp_path / "state"), "NO_COLOR": "1", "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "tether.cli", "exec", "whisper", "text=Through The CLI", "--type",
                          "action", "--config", str(path), "--json"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "through the cli" in out.stdout and TOKEN not in out.stdout + out.stderr
    listed = subprocess.run([sys.executable, "-m", "tether.cli", "tools", "--config", str(path)], capture_output=True,
                            text=True, env=env, timeout=120)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "server off is disabled in the config (disabled: true): not started" in listed.stdout
    assert "whisper" in listed.stdout and TOKEN not in listed.stdout + listed.stderr
    # the note is shown at the CLI's default level (warnings), not only with --log-level info
    assert "ignoring the desktop client's own settings ['globalShortcut', 'preferences']" in listed.stderr


def test_entry_type_is_checked():
    with pytest.raises(ValueError, match="type 'websocket' is not one of stdio, http, sse"):
        parse_device_config({"mcpServers": {"x": {"type": "websocket", "url": "ws://127.0.0.1:1"}}})
    with pytest.raises(ValueError, match="sse server 'x' needs a 'url'"):
        parse_device_config({"mcpServers": {"x": {"type": "sse"}}})
    config = parse_device_config({"mcpServers": {"x": {"type": "stdio", "command": "srv", "cwd": "/tmp",
                                                       "env": {"A": "1"}}}})
    [entry] = [c for _, c in config.mcp["default"]["default"].servers() if c.namespace == "x"]
    assert (entry.server_type, entry.cwd, entry.env) == ("stdio", "/tmp", {"A": "1"})
