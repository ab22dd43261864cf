"""One exit code per kind of outcome (issue 32; README "Exit codes", docs/cli-exit-codes.md), over the commands
issue 32 touched, each as a user runs it (a subprocess): usage errors 2, a token that lacks the scope 1 from
every command (the server refused it), a server that cannot be reached 4 with a hint that says why (refused,
TLS, no scheme), an unknown skill in a plan 2 with no task left behind, Ctrl-C 130."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kits.netutil import CLI, free_port
from tests.kits.task import AgentServer
from tether.cli.common import INTERRUPTED, ExitCode

ENV = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "TETHER_ALLOW_ROOT": "1"}


def tether(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env={**ENV, **env}, timeout=60,
                          stdin=subprocess.DEVNULL)


def said(out: subprocess.CompletedProcess[str]) -> str:
    return " ".join((out.stdout + out.stderr).replace("│", " ").split())


@pytest.mark.parametrize("args", [("devcies",), ("devices", "-o", "yaml"), ("tasks", "-o", "nope"),
                                  ("token", "list", "-o", "nope"), ("sessions", "--nope")])
def test_usage_errors_are_2(args: tuple[str, ...], tmp_path: Path) -> None:
    out = tether(*args, TETHER_STATE_DIR=str(tmp_path))
    assert out.returncode == ExitCode.USAGE, said(out)
    assert "Traceback" not in out.stderr


def test_an_unknown_skill_in_a_plan_is_2_and_no_task_is_left(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("- skill: no.such.tool\n  args: {}\n")
    state = {"TETHER_STATE_DIR": str(tmp_path / "state")}
    out = tether("run", "--plan", str(plan), **state)
    assert out.returncode == ExitCode.USAGE, said(out)
    assert "unknown skill 'no.such.tool'" in said(out) and "no task was created" in said(out)
    assert json.loads(tether("tasks", "--json", **state).stdout) == []


async def test_a_missing_scope_is_1_from_every_command(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("- skill: get_system_info\n  args: {}\n")
    async with AgentServer(tmp_path) as server:
        reader = server.store.tokens.create("api", "reader", ["read"])[1]
        env = {**ENV, "TETHER_SERVER": f"http://127.0.0.1:{server.port}", "TETHER_TOKEN": reader}
        commands = [("devices", "pending"), ("exec", "--all", "noop"), ("run", "--plan", str(plan)),
                    ("audit",), ("devices", "approve", "ABCD-EFGH"),
                    ("devices", "refuse", "ABCD-EFGH")]
        for args in commands:
            proc = await asyncio.create_subprocess_exec(*CLI, *args, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
            _, err = (b.decode() for b in await asyncio.wait_for(proc.communicate(), 60))
            assert proc.returncode == ExitCode.FAILED and "lacks the" in err, (args, proc.returncode, err)
            assert "Traceback" not in err, args


def test_a_refused_connection_asks_whether_the_server_runs() -> None:
    out = tether("devices", TETHER_SERVER=f"http://127.0.0.1:{free_port()}", TETHER_TOKEN="x")
    assert out.returncode == ExitCode.UNREACHABLE and "is it running" in said(out)


def test_a_url_without_its_scheme_says_so() -> None:
    out = tether("devices", TETHER_SERVER=f"127.0.0.1:{free_port()}", TETHER_TOKEN="x")
    assert out.returncode == ExitCode.UNREACHABLE, said(out)
    assert "needs its scheme" in said(out) and "is it running" not in said(out)


@pytest.fixture
def untrusted_tls(pki: dict[str, Path]) -> Iterator[int]:
    """A TLS listener whose certificate no default trust store knows: every handshake fails on the client."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki["cert"], pki["key"])
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass
            except (OSError, ssl.SSLError):
                pass

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    yield listener.getsockname()[1]
    stop.set()
    worker.join(5)
    listener.close()


def test_a_tls_failure_says_tls_not_is_it_running(untrusted_tls: int) -> None:
    out = tether("devices", TETHER_SERVER=f"https://127.0.0.1:{untrusted_tls}", TETHER_TOKEN="x")
    assert out.returncode == ExitCode.UNREACHABLE, said(out)
    assert "TLS" in said(out) and "--ca-file" in said(out) and "is it running" not in said(out)


def test_ctrl_c_is_130() -> None:
    """A command waiting on a server that never answers, interrupted: 130, as documented."""
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog) and never answers
    try:
        proc = subprocess.Popen([*CLI, "tasks"], env={**ENV, "TETHER_SERVER": f"http://127.0.0.1:{silent.getsockname()[1]}",
                                                      "TETHER_TOKEN": "x"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        silent.settimeout(120)
        conn, _ = silent.accept()  # the CLI is up and connected: wait for its whole request, then interrupt it
        with conn:
            conn.settimeout(120)
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(65536)
                assert chunk, "the CLI closed the connection before sending its request"
                request += chunk
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
    finally:
        silent.close()
    assert proc.returncode == INTERRUPTED == 130, err
    assert "Traceback" not in err
    assert sys.platform != "win32"


async def test_an_unknown_skill_on_a_server_is_2_and_no_task_is_created(tmp_path: Path) -> None:
    from tether.tools.policy.model import default_policy

    plan = tmp_path / "plan.yaml"
    plan.write_text("- skill: no.such.tool\n  args: {}\n")
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", default_policy(), tmp_path / "state-alpha")
        env = {**ENV, "TETHER_SERVER": f"http://127.0.0.1:{server.port}", "TETHER_TOKEN": server.token}
        proc = await asyncio.create_subprocess_exec(*CLI, "run", "--device", "alpha", "--plan", str(plan), env=env,
                                                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = (b.decode() for b in await asyncio.wait_for(proc.communicate(), 60))
        tasks = (await server.api.get("/tasks")).json()
    assert proc.returncode == ExitCode.USAGE and "unknown skill 'no.such.tool'" in err, err
    assert tasks == []
