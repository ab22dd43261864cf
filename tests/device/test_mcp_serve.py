"""`tether mcp serve --stdio` driven by the official `mcp` SDK client, launched from a desktop-client-style
config entry as Claude Desktop would: this machine's built-in tools and an external server's in one list,
calls under the device's policy (a refusal and a held call are tool errors that say why), streamed output
as progress notifications. `tether tools serve NAME` keeps working beside it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import mcp_types
import pytest
from mcp import Client, StdioServerParameters

ANNOTATED = Path(__file__).parent.parent / "servers" / "annotated.py"
TETHER = str(Path(sys.executable).parent / "tether")
TIMEOUT = 60.0


def _client_config(tmp_path: Path) -> Path:
    """The MCP client's own config file, pointing at tether, and tether's device config beside it."""
    device = tmp_path / "tether.json"
    device.write_text(json.dumps({"mcpServers": {"ann": {"command": sys.executable, "args": [str(ANNOTATED)]}}}))
    client = tmp_path / "claude_desktop_config.json"
    client.write_text(json.dumps({"globalShortcut": "", "mcpServers": {"tether": {
        "command": TETHER, "args": ["mcp", "serve", "--stdio", "--config", str(device)],
        "env": {"TETHER_STATE_DIR": str(tmp_path / "state"), "HOME": str(tmp_path)}}}}))
    return client


def _params(config: Path) -> StdioServerParameters:
    entry = json.loads(config.read_text())["mcpServers"]["tether"]
    return StdioServerParameters(command=entry["command"], args=entry["args"], env={**os.environ, **entry["env"]})


def _text(result: mcp_types.CallToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, mcp_types.TextContent))


async def test_desktop_client_lists_and_calls_builtin_and_external_tools(tmp_path):
    note = tmp_path / "note.txt"
    note.write_text("hello from the device\n")
    async with Client(_params(_client_config(tmp_path)), read_timeout_seconds=TIMEOUT) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert {"shell.run", "read_file", "write_file", "read_text", "delete"} <= set(tools), sorted(tools)
        assert tools["read_text"].annotations.read_only_hint is True  # the external server's annotation
        assert tools["shell.run"].annotations.destructive_hint is True
        assert tools["read_file"].input_schema["required"] == ["file_path"]

        built_in = await client.call_tool("read_file", {"file_path": str(note)}, read_timeout_seconds=TIMEOUT)
        assert not built_in.is_error and "hello from the device" in _text(built_in) + json.dumps(
            built_in.structured_content)
        external = await client.call_tool("read_text", {"path": str(note)}, read_timeout_seconds=TIMEOUT)
        assert not external.is_error and "hello from the device" in _text(external), external

        refused = await client.call_tool("read_file", {"file_path": "/etc/shadow"}, read_timeout_seconds=TIMEOUT)
        assert refused.is_error and "outside the allowed roots" in _text(refused), refused

        held = await client.call_tool("delete", {"path": str(note)}, read_timeout_seconds=TIMEOUT)
        assert held.is_error and "--approve" in _text(held) and "Nothing was run" in _text(held), held
        assert note.exists()  # the destructive call was not run

        events: list[tuple[float, float | None, str | None]] = []

        async def progress(done: float, total: float | None, message: str | None) -> None:
            events.append((done, total, message))

        echoed = await client.call_tool("shell.run", {"cmd": "echo", "argv": ["streamed-line"], "cwd": str(tmp_path)},
                                        read_timeout_seconds=TIMEOUT, progress_callback=progress)
        assert not echoed.is_error, echoed
        assert any("streamed-line" in (m or "") for _, _, m in events), events


async def test_tools_serve_name_still_serves_one_set(tmp_path):
    params = StdioServerParameters(command=TETHER, args=["tools", "serve", "system"],
                                   env={**os.environ, "TETHER_STATE_DIR": str(tmp_path / "state")})
    async with Client(params, read_timeout_seconds=TIMEOUT) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        assert names and "read_file" not in names and "shell.run" not in names


async def test_serve_without_a_transport_is_a_usage_error(tmp_path):
    import asyncio

    proc = await asyncio.create_subprocess_exec(TETHER, "mcp", "serve", stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE,
                                                env={**os.environ, "TETHER_STATE_DIR": str(tmp_path)})
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode == 2 and err.decode().startswith("error: say how to serve: --stdio"), err
    assert b"Traceback" not in out + err




def _answering(decision: str, asked: list[str]) -> Any:
    async def answer(context: Any, params: mcp_types.ElicitRequestParams) -> mcp_types.ElicitResult:
        asked.append(params.message)
        assert params.requested_schema["properties"]["decision"]["enum"] == ["approve once", "deny"]
        return mcp_types.ElicitResult(action="accept", content={"decision": decision})

    return answer


@pytest.mark.parametrize("mode", ["auto", "legacy"])  # 2026-07-28 input-required retry; handshake-era elicitation
async def test_a_held_call_is_asked_through_elicitation(tmp_path, mode):
    kept, gone = tmp_path / "kept.txt", tmp_path / "gone.txt"
    kept.write_text("keep me")
    gone.write_text("delete me")
    params = _params(_client_config(tmp_path))
    asked: list[str] = []
    async with Client(params, read_timeout_seconds=TIMEOUT, elicitation_callback=_answering("deny", asked),
                      mode=mode) as client:
        denied = await client.call_tool("delete", {"path": str(kept)}, read_timeout_seconds=TIMEOUT)
    assert denied.is_error and "not run: the approval was denied" in _text(denied), denied
    assert kept.exists() and len(asked) == 1 and "delete" in asked[0]
    async with Client(params, read_timeout_seconds=TIMEOUT, elicitation_callback=_answering("approve once", asked),
                      mode=mode) as client:
        approved = await client.call_tool("delete", {"path": str(gone)}, read_timeout_seconds=TIMEOUT)
    assert not approved.is_error and "deleted" in _text(approved), approved
    assert not gone.exists() and len(asked) == 2


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_an_approval_is_for_what_was_asked_about_not_what_is_there_when_it_comes(tmp_path, mode):
    """The file a held call names changes while the question waits (the client's agent rewrote it, or anything
    else did): the person approved deleting what they were asked about, so nothing is deleted and the call says
    it changed (the approval carries the question's digest, which the device checks again)."""
    target = tmp_path / "draft.txt"
    target.write_text("a scratch draft")
    asked: list[str] = []

    async def swap_then_approve(context: Any, params: mcp_types.ElicitRequestParams) -> mcp_types.ElicitResult:
        asked.append(params.message)
        target.write_text("the only copy of the thesis")
        return mcp_types.ElicitResult(action="accept", content={"decision": "approve once"})

    async with Client(_params(_client_config(tmp_path)), read_timeout_seconds=TIMEOUT,
                      elicitation_callback=swap_then_approve, mode=mode) as client:
        result = await client.call_tool("delete", {"path": str(target)}, read_timeout_seconds=TIMEOUT)
    assert len(asked) == 1 and target.read_text() == "the only copy of the thesis", result
    assert result.is_error and "what was approved has changed since" in _text(result), result


def _running(marker: str) -> list[int]:
    """Processes (not zombies) whose command line names `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(pid))
    return found


async def test_a_cancelled_call_kills_its_process(tmp_path):
    import anyio

    follow = tmp_path / "follow-me-7c1e.txt"
    follow.write_text("started-marker\n")
    started = anyio.Event()

    async def progress(done: float, total: float | None, message: str | None) -> None:
        if "started-marker" in (message or ""):
            started.set()

    async with Client(_params(_client_config(tmp_path)), read_timeout_seconds=TIMEOUT) as client:
        async with anyio.create_task_group() as tg:
            async def call() -> None:
                await client.call_tool("shell.run", {"cmd": "tail", "argv": ["-f", str(follow)],
                                                     "cwd": str(tmp_path)},
                                       read_timeout_seconds=TIMEOUT, progress_callback=progress)

            tg.start_soon(call)
            with anyio.fail_after(TIMEOUT):
                await started.wait()  # tail runs and has printed the file
            assert _running(follow.name)
            tg.cancel_scope.cancel()  # the SDK sends notifications/cancelled
        # calls run one at a time on the device: this one starts once the cancelled one was torn down
        after = await client.call_tool("shell.run", {"cmd": "true", "cwd": str(tmp_path)},
                                       read_timeout_seconds=TIMEOUT)
        assert not after.is_error, after
        assert _running(follow.name) == []
