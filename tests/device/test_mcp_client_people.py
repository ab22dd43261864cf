"""An external MCP server's progress and questions reach people: `tether exec` on this machine (a
real terminal through a pty, or none), and a real server and device process, through REST SSE and
the question endpoint. The server is tests/servers/interactive.py, a real stdio MCP server."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.kits.netutil import CLI, Cluster, tether_env
from tests.kits.sse import sse_events
from tether.protocol.models import Command, ResultStatus

INTERACTIVE = str(Path(__file__).parent.parent / "servers" / "interactive.py")


def mcp_config(tmp_path: Path) -> Path:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"interactive": {"command": sys.executable, "args": [INTERACTIVE]}}}))
    return path


def exec_local(tmp_path: Path, *args: str, stdin: Any = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    state = tmp_path / "state"
    return subprocess.run([*CLI, "exec", "--config", str(mcp_config(tmp_path)), "--state-dir", str(state), *args],
                          stdin=stdin, capture_output=True, text=True, env=tether_env(state), timeout=120)


def test_progress_is_shown_by_tether_exec(tmp_path: Path) -> None:
    ran = exec_local(tmp_path, "count", "steps=3")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "counted 3" in ran.stdout
    lines = [line for line in ran.stderr.splitlines() if line.startswith("progress ")]
    assert lines == ["progress interactive.count: 1/3 step 1 of 3", "progress interactive.count: 2/3 step 2 of 3",
                     "progress interactive.count: 3/3 step 3 of 3"]


def test_a_question_is_asked_at_the_terminal(tmp_path: Path) -> None:
    master, slave = pty.openpty()
    try:
        os.write(master, b"blue\n")  # typed ahead: it waits in the terminal until the question reads it
        ran = exec_local(tmp_path, "ask", "question=Which [b]colour[/b]?", stdin=slave)
    finally:
        os.close(master)
        os.close(slave)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "\naccept: blue\n" in ran.stdout  # the tool's text, printed as text
    assert "MCP server interactive asks: Which [b]colour[/b]?" in ran.stderr  # never read as markup
    assert "Traceback" not in ran.stderr


def test_without_a_terminal_the_question_is_declined(tmp_path: Path) -> None:
    ran = exec_local(tmp_path, "ask", "question=Which colour?")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "\ndecline\n" in ran.stdout


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()


def run_streamed(cluster: Cluster, tool: str, params: dict[str, Any], http: httpx.Client
                 ) -> Iterator[tuple[str, Any]]:
    body = {"commands": [{"tool_name": tool, "parameters": params}], "timeout": 60}
    headers = {"Authorization": f"Bearer {cluster.api_token}", "Accept": "text/event-stream"}
    with http.stream("POST", "/api/v1/devices/alpha/commands", json=body, headers=headers) as response:
        assert response.status_code == 200
        yield from sse_events(response.iter_lines())


@pytest.fixture
def alpha(cluster: Cluster, tmp_path: Path) -> Cluster:
    proc = cluster.device("alpha", extra=("--config", str(mcp_config(tmp_path))))
    cluster.wait_online("alpha", proc)
    return cluster


def test_progress_reaches_the_rest_stream(alpha: Cluster) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{alpha.port}", timeout=60) as http:
        seen = list(run_streamed(alpha, "count", {"steps": 2}, http))
    progress = [d["data"] for name, d in seen if name == "event" and d["kind"] == "progress"]
    assert [(p["progress"], p["total"], p["message"], p["server"]) for p in progress] == [
        (1, 2, "step 1 of 2", "interactive"), (2, 2, "step 2 of 2", "interactive")]
    [results] = [d for name, d in seen if name == "results"]
    assert results["results"][0]["status"] == "success"


def test_a_question_is_answered_through_the_server(alpha: Cluster) -> None:
    base = f"http://127.0.0.1:{alpha.port}"
    admin = {"Authorization": f"Bearer {alpha.api_token}"}
    with httpx.Client(base_url=base, timeout=60) as http:
        made = http.post("/api/v1/tokens", json={"kind": "api", "name": "runner", "scopes": ["execute"]},
                         headers=admin)
        assert made.status_code == 201, made.text
        runner = {"Authorization": f"Bearer {made.json()['token']}"}
        missing = http.post("/api/v1/devices/alpha/questions/qnothing", json={"action": "accept"}, headers=admin)
        assert missing.status_code == 404 and "error" in missing.json()
        nobody = http.post("/api/v1/devices/nobody/questions/q1", json={"action": "accept"}, headers=admin)
        assert nobody.status_code == 404 and "nobody" in nobody.json()["error"]
        answered: list[dict[str, Any]] = []
        stream = run_streamed(alpha, "ask", {"question": "Which colour?"}, http)
        for name, data in stream:
            if name == "event" and data["kind"] == "elicitation":
                question = data["data"]
                assert question["message"] == "Which colour?" and "colour" in question["schema"]["properties"]
                url = f"/api/v1/devices/alpha/questions/{question['id']}"
                refused = http.post(url, json={"action": "accept", "content": {"colour": "red"}}, headers=runner)
                assert refused.status_code == 403 and "approve" in refused.json()["error"]
                bad = http.post(url, json={"action": "maybe"}, headers=admin)
                assert bad.status_code == 422 and "error" in bad.json()
                ok = http.post(url, json={"action": "accept", "content": {"colour": "green"}}, headers=admin)
                assert ok.status_code == 200, ok.text
                again = http.post(url, json={"action": "accept", "content": {"colour": "green"}}, headers=admin)
                assert again.status_code == 404  # answered once
            elif name == "event" and data["kind"] == "elicitation_answered":
                answered.append(data["data"])
            elif name == "results":
                [result] = data["results"]
                break
    assert result["status"] == "success", result
    assert "accept: green" in json.dumps(result["result"])
    assert [a["action"] for a in answered] == ["accept"]


def test_remote_exec_asks_at_the_terminal_and_posts_the_answer(alpha: Cluster) -> None:
    env = {**alpha.env, "TETHER_SERVER": f"http://127.0.0.1:{alpha.port}", "TETHER_TOKEN": alpha.api_token}
    master, slave = pty.openpty()
    try:
        os.write(master, b"purple\n")
        ran = subprocess.run([*CLI, "exec", "--device", "alpha", "ask", "question=Which colour?", "--json"],
                             stdin=slave, capture_output=True, text=True, env=env, timeout=120)
    finally:
        os.close(master)
        os.close(slave)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "accept: purple" in ran.stdout
    assert "MCP server interactive asks: Which colour?" in ran.stderr


def test_remote_exec_without_a_terminal_says_how_to_answer(alpha: Cluster) -> None:
    env = {**alpha.env, "TETHER_SERVER": f"http://127.0.0.1:{alpha.port}", "TETHER_TOKEN": alpha.api_token}
    # the external server joins after the device registers: the 3 s below are for the question, not its start
    _, [joined] = alpha.remote.run("alpha", [Command(tool_name="count", parameters={"steps": 1})], timeout=60)
    assert joined.status is ResultStatus.SUCCESS, joined.error
    ran = subprocess.run([*CLI, "exec", "--device", "alpha", "ask", "question=Which colour?", "--timeout", "3"],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=120)
    assert "MCP server interactive asks (question q" in ran.stderr
    assert "/api/v1/devices/alpha/questions/q" in ran.stderr
    assert "Traceback" not in ran.stderr


def test_remote_exec_shows_progress(alpha: Cluster) -> None:
    env = {**alpha.env, "TETHER_SERVER": f"http://127.0.0.1:{alpha.port}", "TETHER_TOKEN": alpha.api_token}
    ran = subprocess.run([*CLI, "exec", "--device", "alpha", "count", "steps=2"], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, env=env, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert [line for line in ran.stderr.splitlines() if line.startswith("progress ")] == [
        "progress interactive.count: 1/2 step 1 of 2", "progress interactive.count: 2/2 step 2 of 2"]


def test_an_unanswered_question_ends_with_its_command(alpha: Cluster) -> None:
    """Nobody answers: the command's own timeout ends it (the call is cancelled on the device), and the
    question can no longer be answered."""
    base = f"http://127.0.0.1:{alpha.port}"
    # the device registers before its external server has joined: a first call waits for it, so the
    # 2 s below measure the unanswered question, not the server's start on a loaded machine
    _, [joined] = alpha.remote.run("alpha", [Command(tool_name="count", parameters={"steps": 1})], timeout=60)
    assert joined.status is ResultStatus.SUCCESS, joined.error
    with httpx.Client(base_url=base, timeout=60) as http:
        body = {"commands": [{"tool_name": "ask", "parameters": {"question": "Anyone?"}}], "timeout": 2}
        headers = {"Authorization": f"Bearer {alpha.api_token}", "Accept": "text/event-stream"}
        question_id = None
        with http.stream("POST", "/api/v1/devices/alpha/commands", json=body, headers=headers) as response:
            for name, data in sse_events(response.iter_lines()):
                if name == "event" and data["kind"] == "elicitation":
                    question_id = data["data"]["id"]
                elif name == "results":
                    [result] = data["results"]
        late = http.post(f"/api/v1/devices/alpha/questions/{question_id}", json={"action": "decline"},
                         headers={"Authorization": f"Bearer {alpha.api_token}"})
    assert question_id is not None
    # the device's own timeout cancels the call; the server's wait ends at the same moment: whichever
    # comes first, the caller hears "timed out" (failure) or "outcome pending" (none, settled late), never success
    assert (result["status"] == "failure" and "timed out" in result["error"]) or (
        result["status"] == "none" and result["error"].startswith("outcome pending")), result
    assert late.status_code == 404
    _, [again] = alpha.remote.run("alpha", [Command(tool_name="count", parameters={"steps": 1})], timeout=30)
    assert again.status is ResultStatus.SUCCESS, again.error  # the device and its server stay usable


def test_a_local_run_asks_an_mcp_question_once(tmp_path: Path) -> None:
    """`tether run` prompts an external server's question in the terminal; the task's own display
    does not print it a second time."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"skill": "ask", "args": {"question": "Which colour?"}}]))
    state = tmp_path / "state"
    master, slave = pty.openpty()
    try:
        os.write(master, b"blue\n")
        ran = subprocess.run([*CLI, "run", "--plan", str(plan), "--config", str(mcp_config(tmp_path)),
                              "--state-dir", str(state)], stdin=slave, capture_output=True, text=True,
                             env=tether_env(state), timeout=120)
    finally:
        os.close(master)
        os.close(slave)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert (ran.stdout + ran.stderr).count("asks: Which colour?") == 1, ran.stdout + ran.stderr
