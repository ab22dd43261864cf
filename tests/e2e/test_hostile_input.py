"""Input nobody wrote down, as a user or an attacker gives it to real processes (a `tether server`, a `tether
device`, the `tether` command): each is answered with one clear line and its exit code, never a Python traceback;
a device name is one name (never a path that leads to another device); the server's log stays free of
tracebacks for a refusal it makes on purpose."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.kits.netutil import CLI, Cluster
from tether.cli.common import ExitCode

NOT_UTF8 = os.fsdecode(b"\xff\xfe")  # what Python makes of an argument in another encoding (surrogate escapes)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    fleet = Cluster(tmp_path_factory.mktemp("hostile"))
    try:
        fleet.wait_online("alpha", fleet.device("alpha"))
        yield fleet
    finally:
        fleet.close()


def tether(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{cluster.port}", "TETHER_TOKEN": cluster.api_token,
           "TETHER_ALLOW_ROOT": "1"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=90,
                          stdin=subprocess.DEVNULL, errors="replace")


def one_clear_error(out: subprocess.CompletedProcess[str], code: int) -> str:
    """The run ended with `code` and said why in an `error:` line, without a traceback; its words, joined."""
    words = " ".join((out.stdout + out.stderr).replace("│", " ").split())
    assert out.returncode == code, words
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, words
    assert "error:" in out.stderr, words
    return words


@pytest.mark.parametrize(("where", "timeout"), [(("--device", "alpha"), "inf"), (("--device", "alpha"), "-1"),
                                                (("--all",), "1e308"), ((), "inf")])
def test_a_timeout_that_is_not_a_duration_is_a_usage_error(cluster: Cluster, timeout: str,
                                                           where: tuple[str, ...]) -> None:
    """On a server's device, on every device (`--all`) and on this machine (no `--device`)."""
    words = one_clear_error(tether(cluster, "exec", *where, "--timeout", timeout, "get_system_info"), ExitCode.USAGE)
    assert "--timeout" in words


@pytest.mark.parametrize(("args", "code"), [
    (("exec", "--device", "alpha", "shell.run", f"cmd={NOT_UTF8}", "cwd=/tmp"), ExitCode.USAGE),
    (("log", NOT_UTF8), ExitCode.FAILED), (("batch", NOT_UTF8), ExitCode.FAILED),
    (("tools", "--device", NOT_UTF8), ExitCode.USAGE), (("devices", NOT_UTF8), ExitCode.FAILED),
])
def test_an_argument_that_is_not_utf8_is_refused_in_one_line(cluster: Cluster, args: tuple[str, ...],
                                                              code: int) -> None:
    """A JSON body cannot carry it (refused before anything is sent); in a URL it is sent as its bytes, and the
    server answers that there is no such thing."""
    words = one_clear_error(tether(cluster, *args), code)
    assert "is not UTF-8 text (bytes b'\\xff\\xfe')" in words or "404" in words


@pytest.mark.parametrize("name", ["nobody/../alpha", "alpha/", "%61lpha", "a\x1b[2Jb"])
def test_a_device_name_is_never_a_path_to_another_device(cluster: Cluster, name: str) -> None:
    """`--device NAME` from a script's input: a name with a slash, a `%`, an escape or a control character
    reaches no device (alpha must not run it, nor be shown: a refusal, never a success)."""
    for args, code in ((("exec", "--device", name, "get_system_info"), ExitCode.USAGE),
                       (("tools", "--device", name), ExitCode.USAGE), (("devices", name), ExitCode.FAILED)):
        words = one_clear_error(tether(cluster, *args), code)
        # the name as sent: no such device (404), or `alpha/`'s redirect to alpha, refused (307: never followed)
        assert ("404" in words or ("307" in words and "not followed" in words)) and "success" not in words \
            and "shell.run" not in words, words


def test_an_unknown_log_level_is_refused_before_the_server_starts(tmp_path: Path) -> None:
    out = subprocess.run([*CLI, "server", "--port", "1", "--log-level", "loud"], capture_output=True, text=True,
                         env={**os.environ, "TETHER_STATE_DIR": str(tmp_path)}, timeout=60, stdin=subprocess.DEVNULL)
    words = one_clear_error(out, ExitCode.USAGE)
    assert "--log-level must be debug, info, warning or error" in words


def test_an_oversized_chunked_command_body_is_a_413_without_a_traceback_in_the_log(cluster: Cluster) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"commands": [{"tool_name": "list_tools", "parameters": {"x": "'
        for _ in range(80):
            yield b"a" * 65536  # 5 MiB in all: past the 4 MiB default
        yield b'"}}]}'

    before = cluster.server.output()
    answer = httpx.post(f"http://127.0.0.1:{cluster.port}/api/v1/devices/alpha/commands", content=chunks(),
                        headers={"Authorization": f"Bearer {cluster.api_token}", "Content-Type": "application/json"},
                        timeout=60)
    assert answer.status_code == 413 and "max_body_bytes" in answer.json()["error"]
    assert "Traceback" not in cluster.server.output()[len(before):]


@pytest.mark.parametrize("content_type", ["text/xml", "text/plain", ""])
def test_mcp_refuses_a_body_that_is_not_json_with_a_json_error(cluster: Cluster, content_type: str) -> None:
    answer = httpx.post(f"http://127.0.0.1:{cluster.port}/mcp", content=b"<x/>", timeout=30,
                        headers={"Authorization": f"Bearer {cluster.api_token}", "Content-Type": content_type,
                                 "Accept": "application/json, text/event-stream"})
    assert answer.status_code == 400 and answer.headers["content-type"] == "application/json"
    assert answer.json() == {"error": "Invalid Content-Type header"}


@pytest.mark.parametrize("path", ["%00", "a%00b", "..%2f%00"])
def test_a_nul_in_an_asset_path_is_a_404_not_a_500(cluster: Cluster, path: str) -> None:
    """Anyone may ask for the dashboard's files (no token): a NUL byte in the name is no such file, and leaves no
    traceback in the server's log."""
    before = cluster.server.output()
    answer = httpx.get(f"http://127.0.0.1:{cluster.port}/web/static/{path}", timeout=30)
    assert answer.status_code == 404 and "no asset" in answer.json()["error"]
    assert "Traceback" not in cluster.server.output()[len(before):]


def test_a_misspelt_task_state_is_refused_not_an_empty_list(cluster: Cluster) -> None:
    """`tether tasks --state runing` must not say "no tasks" (a person would believe nothing runs)."""
    words = one_clear_error(tether(cluster, "tasks", "--state", "runing"), ExitCode.FAILED)
    assert "422" in words and "running" in words
    assert tether(cluster, "tasks", "--state", "running").returncode == 0
    words = one_clear_error(tether(cluster, "tasks", "--local", "--state", "runing"), ExitCode.USAGE)
    assert "--state must be one of" in words and "running" in words


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:1\x1b[2J"])
@pytest.mark.parametrize("args", [("devices",), ("exec", "--device", "alpha", "get_system_info"), ("tasks",)])
def test_a_server_url_that_is_not_a_url_is_one_line(cluster: Cluster, url: str, args: tuple[str, ...]) -> None:
    """TETHER_SERVER mistyped: the server cannot be reached (exit 4), said in one line with the usual hint."""
    env = {**cluster.env, "TETHER_SERVER": url, "TETHER_TOKEN": cluster.api_token}
    out = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=90, stdin=subprocess.DEVNULL)
    words = one_clear_error(out, ExitCode.UNREACHABLE)
    assert "cannot reach the tether server" in words and "\x1b" not in out.stderr


@pytest.mark.parametrize("request_bytes", [b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\nX-A: \x01\r\n\r\n",
                                           b"NOT HTTP AT ALL\r\n\r\n"])
def test_a_request_the_parser_refuses_is_answered_json(cluster: Cluster, request_bytes: bytes) -> None:
    """Bytes that are not HTTP/1.1 (a control character in a header, garbage): 400 `{"error": …}`, as every other
    HTTP error of the server, and the connection closed."""
    import json
    import socket

    with socket.create_connection(("127.0.0.1", cluster.port), timeout=30) as sock:
        sock.sendall(request_bytes)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), answer
    assert "error" in json.loads(body)


@pytest.mark.parametrize("path", ["/audit?limit=-1", "/audit?limit=0", "/tasks?limit=-5", "/tasks?limit=0"])
def test_a_page_size_below_one_is_a_422_not_a_silent_page(cluster: Cluster, path: str) -> None:
    """A negative or zero `limit` is refused naming the parameter, as a mistyped one would be; an oversized one
    is served at the route's most."""
    answer = httpx.get(f"http://127.0.0.1:{cluster.port}/api/v1{path}",
                       headers={"Authorization": f"Bearer {cluster.api_token}"}, timeout=30)
    assert answer.status_code == 422 and set(answer.json()) == {"error"} and "limit" in answer.text, answer.text
    big = httpx.get(f"http://127.0.0.1:{cluster.port}/api/v1{path.split('?')[0]}?limit=100000",
                    headers={"Authorization": f"Bearer {cluster.api_token}"}, timeout=30)
    assert big.status_code == 200, big.text
    refused = tether(cluster, "tasks", "--limit", "0")  # the usage error of every option out of its range
    assert refused.returncode == ExitCode.USAGE and "Traceback" not in refused.stderr, refused.stderr
    assert "Invalid value for '--limit'" in refused.stderr, refused.stderr
