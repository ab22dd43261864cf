"""The gateway with real `tether server` and `tether device` processes: a client's cancellation kills the
command's process on the device, and a command the device's policy holds for a person (ask on miss) is asked
through the client's elicitation, approved or denied, or refused at once for a client that cannot be asked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import psutil
import pytest

from tests.kits.gateway import mcp_client
from tests.kits.netutil import Cluster, wait_for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("gateway")
    # no test here is about liveness: the kit's 2 s heartbeat timeout (for the tests that watch a device go
    # offline) dropped alpha when a loaded machine left its process unscheduled that long, and a call made then
    # found no tool 'alpha__shell.run' instead of the policy's question; 60 s is the bound, not a wait
    c = Cluster(tmp, server_args=LIVENESS)
    policy = tmp / "policy.yaml"
    policy.write_text("ask: on-miss\n")
    c.alpha = c.device("alpha", extra=("--policy", str(policy)))  # type: ignore[attr-defined]
    c.wait_online("alpha", c.alpha)  # type: ignore[attr-defined]
    yield c
    c.close()


LIVENESS = ("--heartbeat-interval", "5", "--heartbeat-timeout", "60", "--grace-period", "60")


def url(cluster: Cluster) -> str:
    return f"http://127.0.0.1:{cluster.port}/mcp"


def sleeper(device_pid: int) -> psutil.Process | None:
    try:
        return next((p for p in psutil.Process(device_pid).children(recursive=True)
                     if p.name() == "sleep" and "300" in p.cmdline()), None)
    except psutil.NoSuchProcess:
        return None


async def test_cancelling_the_call_kills_the_process_on_the_device(cluster: Cluster, tmp_path: Path) -> None:
    device_pid = cluster.alpha.pid  # type: ignore[attr-defined]
    async with mcp_client(url(cluster), cluster.api_token) as client:
        async with anyio.create_task_group() as group:
            group.start_soon(client.call_tool, "alpha__shell.run",
                             {"cmd": "sleep", "argv": ["300"], "cwd": str(tmp_path)})
            # the process lives in another process tree: netutil's poll, off the event loop that serves the call
            process = await anyio.to_thread.run_sync(wait_for, lambda: sleeper(device_pid),
                                                     "sleep 300 started on the device", 120)
            assert isinstance(process, psutil.Process)
            group.cancel_scope.cancel()  # the SDK sends notifications/cancelled
        # psutil.TimeoutExpired if the command was left running (in a thread: the client still has to send)
        await anyio.to_thread.run_sync(lambda: process.wait(timeout=15))
        assert not process.is_running()
        echo = await client.call_tool("alpha__shell.run", {"cmd": "echo", "argv": ["next"], "cwd": str(tmp_path)})
        assert not echo.is_error and echo.structured_content is not None
        assert echo.structured_content["stdout"] == "next\n"


def answer(decision: str, asked: list[str], offered: list[list[str]] | None = None) -> Any:
    async def elicitation(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        schema = params.requested_schema  # type: ignore[union-attr]
        if offered is not None:
            offered.append(schema["properties"]["decision"]["enum"])
        return types.ElicitResult(action="accept", content={"decision": decision})

    return elicitation


async def test_an_approval_is_asked_through_elicitation(cluster: Cluster, tmp_path: Path) -> None:
    args = {"cmd": "nproc", "argv": ["--all"], "cwd": str(tmp_path)}
    asked: list[str] = []
    offered: list[list[str]] = []
    async with mcp_client(url(cluster), cluster.api_token, elicitation_callback=answer("approve once", asked, offered),
                          client_info=types.Implementation(name="desk", version="3")) as client:
        approved = await client.call_tool("alpha__shell.run", args)
    assert not approved.is_error, approved.content
    # an admin token may also allow it from now on, as `tether exec --always` can
    assert offered == [["approve once", "always allow nproc", "deny"]]
    assert approved.structured_content is not None and approved.structured_content["exitCode"] == 0
    [question] = asked
    assert "Device alpha" in question and "`nproc --all`" in question
    rows = cluster.remote._request("GET", "/audit", params={"device": "alpha", "limit": 5})["rows"]
    ran = next(r for r in rows if r["status"] == "success" and r["tool_name"] == "shell.run")
    assert ran["approved_by"] == "mcp:desk/3 by api:tests" and ran["requested_by"] == "mcp:desk/3 by api:tests"

    asked.clear()
    async with mcp_client(url(cluster), cluster.api_token, elicitation_callback=answer("deny", asked)) as client:
        denied = await client.call_tool("alpha__shell.run", args)
    assert denied.is_error and denied.content[0].text.startswith("not run: the approval was denied")
    assert len(asked) == 1


async def test_a_client_that_cannot_be_asked_is_answered_at_once(cluster: Cluster, tmp_path: Path) -> None:
    args = {"cmd": "nproc", "argv": ["--all"], "cwd": str(tmp_path)}
    async with mcp_client(url(cluster), cluster.api_token) as client:
        held = await client.call_tool("alpha__shell.run", args)
    text = held.content[0].text
    assert held.is_error and "needs approval" in text and "did not declare the elicitation capability" in text
    assert "tether exec --device alpha shell.run" in text and "--approve" in text

    made = cluster.remote._request("POST", "/tokens", json={"kind": "api", "name": "executor", "scopes": ["execute"]})
    executor = made["token"]
    asked: list[str] = []
    async with mcp_client(url(cluster), executor, elicitation_callback=answer("approve once", asked)) as client:
        refused = await client.call_tool("alpha__shell.run", args)
    assert refused.is_error and "lacks the 'approve' scope" in refused.content[0].text and asked == []


async def test_always_allow_adds_the_program_to_the_devices_allowlist(cluster: Cluster, tmp_path: Path) -> None:
    asked: list[str] = []
    offered: list[list[str]] = []
    args = {"cmd": "expr", "argv": ["1", "+", "1"], "cwd": str(tmp_path)}
    async with mcp_client(url(cluster), cluster.api_token,
                          elicitation_callback=answer("always allow expr 1", asked, offered)) as client:
        first = await client.call_tool("alpha__shell.run", args)
        assert not first.is_error and first.structured_content["stdout"] == "2\n"  # type: ignore[index]
        assert offered == [["approve once", "always allow expr", "always allow expr 1", "deny"]]
        again = await client.call_tool("alpha__shell.run", args)  # allowed now: nobody is asked
        assert not again.is_error and len(asked) == 1
        other = await client.call_tool("alpha__shell.run", {**args, "argv": ["2", "+", "2"]})
        assert other.is_error and other.structured_content == {"denied": True, "rule": "subcommand"}, other
        assert len(asked) == 1, "only the subcommand '1' was allowed: 'expr 2' is refused, not asked"
    rows = cluster.remote._request("GET", "/audit", params={"device": "alpha", "limit": 20})["rows"]
    change = next(r for r in rows if r["tool_name"] == "policy.set")
    assert change["status"] == "success" and change["requested_by"] == "mcp:mcp/0.1.0 by api:tests"
