"""Issue 27, item 5 as an attacker tries it against a real `tether server` on 127.0.0.1: hold every file
descriptor with half-open connections, sit on a connection saying nothing, guess pairing codes and bearer
tokens as fast as the server answers, call it from a page on another port of the same host, and put
terminal escapes where a person will read them: a pairing request, a task's request and plan, a device's
output (`tether devices pending`, `tasks`, `log`, `audit`, `exec`).

Each attacker speaks from its own loopback address (127.0.0.2, .3, …: Linux routes all of 127.0.0.0/8 to
lo), as another machine would, so the server's per-address caps and throttles meet it and not the test's
own requests from 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.kits.netutil import CLI, Cluster, wait_for
from tests.kits.server_target import Target, connect_raw, error_of, read_response, upgrade_request
from tether.device.link.trust.device_key import DeviceKey
from tether.protocol.identity import claim_statement


def connect_from(source: str, port: int, timeout: float = 30.0) -> socket.socket:
    """A TCP connection to the server on 127.0.0.1 from the loopback address `source`."""
    return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))


def client_from(target: Target, source: str) -> httpx.Client:
    return httpx.Client(base_url=target.base, timeout=30, transport=httpx.HTTPTransport(local_address=source))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    server = Target(tmp_path_factory.mktemp("edge"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def impatient(tmp_path_factory):
    """A server with short timeouts, so that the tests can watch them act."""
    server = Target(tmp_path_factory.mktemp("edge-timeouts"), "--set", "idle_timeout=0.5", "--set",
                    "header_timeout=0.5", "--set", "body_timeout=0.5")
    yield server
    server.close()


# -- descriptors ---------------------------------------------------------------------------------


def test_2000_half_open_connections_under_a_1024_file_limit_do_not_stop_the_server(tmp_path):
    # the server started as `ulimit -n 1024` would start it: the limit is inherited; and the idle timeout
    # (5 s) would close the held connections too: here it waits, so that the caps alone are measured
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        server = Target(tmp_path, "--set", "idle_timeout=120")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        assert resource.prlimit(server.proc.pid, resource.RLIMIT_NOFILE)[0] == 1024
        held: list[socket.socket] = []
        try:
            started = time.monotonic()
            for _ in range(2000):  # connect and never send a byte
                held.append(connect_from("127.0.0.2", server.port, timeout=10))
            print(f"2,000 connections in {time.monotonic() - started:.2f} s")
            # on a new connection: the listening socket's queue is first in, first out, so it is taken after
            # all 2,000, and it is answered
            with httpx.Client(base_url=server.base, timeout=30) as fresh:
                assert fresh.get("/api/v1/health").status_code == 200
                assert fresh.get("/api/v1/devices", headers=server.auth).status_code == 200
            still_open = 0
            seen = {"open": 0, "closed": 0, "reset": 0}
            for sock in held:
                sock.setblocking(False)
                try:
                    seen["open" if sock.recv(1, socket.MSG_PEEK) else "closed"] += 1
                except BlockingIOError:
                    seen["open"] += 1  # open, and nothing said
                except ConnectionResetError:
                    seen["reset"] += 1  # aborted as it was accepted
            print(seen)
            still_open = seen["open"]
            # the loopback cap (max_connections_per_loopback: by default half of the 1,024 files): the
            # rest were closed as they arrived
            assert still_open <= 512, still_open
            assert still_open >= 100, f"only {still_open} of the first connections were kept: a cap far too low?"
        finally:
            for sock in held:
                sock.close()
        assert "HTTP connections open from 127.0.0.2" in server.log()
        assert "Too many open files" not in server.log()
    finally:
        server.close()


def test_a_silent_connection_is_closed_after_the_idle_timeout(impatient):
    with connect_raw(impatient.port, timeout=10) as sock:
        started = time.monotonic()
        assert sock.recv(1024) == b""  # returns when the server closes: the event itself
        waited = time.monotonic() - started
    assert 0.3 < waited < 5, waited


def test_headers_sent_too_slowly_are_answered_408_and_the_connection_closed(impatient):
    with connect_raw(impatient.port, timeout=10) as sock:
        sock.sendall(f"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1:{impatient.port}\r\nX-Slow: ".encode())
        status, head, body = read_response(sock)
        assert status == 408 and head["connection"] == "close" and "header_timeout" in error_of(body)
        assert sock.recv(1024) == b""


def test_a_body_sent_too_slowly_is_answered_408_and_the_connection_closed(impatient):
    with connect_raw(impatient.port, timeout=10) as sock:
        sock.sendall(f"POST /api/v1/pairing HTTP/1.1\r\nHost: 127.0.0.1:{impatient.port}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"fing".encode())
        status, _, body = read_response(sock)
        assert status == 408 and "body_timeout" in error_of(body)
        assert sock.recv(1024) == b""


def test_a_busy_keep_alive_connection_is_not_cut(impatient):
    """The timers bound silence, not use: requests one after another on one connection all pass."""
    with httpx.Client(base_url=impatient.base, timeout=10) as http:
        for _ in range(5):
            assert http.get("/api/v1/health").status_code == 200


def test_websockets_from_one_address_are_capped_separately(tmp_path):
    server = Target(tmp_path, "--set", "max_sockets_per_loopback=3", "--set", "max_connections_per_loopback=2")
    try:
        sockets = []
        try:
            for _ in range(3):  # three device sockets: more than the HTTP cap, within the socket cap
                sock = connect_from("127.0.0.7", server.port)
                sock.sendall(upgrade_request(server.port, headers={"Authorization": f"Bearer {server.device_token}"}))
                status, _, _ = read_response(sock)
                assert status == 101
                sockets.append(sock)
            with connect_from("127.0.0.7", server.port) as sock:
                sock.sendall(upgrade_request(server.port, headers={"Authorization": f"Bearer {server.device_token}"}))
                status, head, body = read_response(sock)
            assert status == 503 and head["retry-after"] and "max_sockets_per_address" in error_of(body)
        finally:
            for sock in sockets:
                sock.close()
    finally:
        server.close()


# -- throttles -----------------------------------------------------------------------------------


def _claim(http: httpx.Client, code: str, key: DeviceKey | None = None) -> httpx.Response:
    """A claim signed by `key` (a stranger's by default: not the key that asked for the code)."""
    key = key or DeviceKey.generate()
    return http.post(f"/api/v1/pairing/{code}/claim",
                     json={"signature": key.sign(claim_statement(code, key.fingerprint)), "wait": 0})


def test_an_unknown_code_and_a_wrong_key_get_the_same_answer(target):
    asker = DeviceKey.generate()
    real = target.http.post("/api/v1/pairing", json={"public_key": asker.public_key, "name": "edge-probe"})
    assert real.status_code == 201, real.text
    code = real.json()["code"]
    with client_from(target, "127.0.0.3") as http:
        wrong_key, unknown = _claim(http, code), _claim(http, "ZZZZ-ZZZZ")
    assert (wrong_key.status_code, wrong_key.content) == (unknown.status_code, unknown.content), (wrong_key.text,
                                                                                                  unknown.text)
    assert unknown.status_code == 404 and "code" not in set(unknown.json()) and code not in unknown.text


def test_a_pairing_code_brute_force_is_throttled(target):
    with client_from(target, "127.0.0.4") as http:
        answers = [_claim(http, f"AAAA-{n:04d}") for n in range(60)]
    statuses = [a.status_code for a in answers]
    assert statuses[:20] == [404] * 20, statuses  # pairing_claim_burst: 20
    throttled = [a for a in answers if a.status_code == 429]
    assert len(throttled) >= 38, statuses  # about one more a 5 s (12 a minute)
    assert int(throttled[-1].headers["retry-after"]) >= 1 and "pairing" in error_of(throttled[-1].content)


def test_one_code_is_throttled_whoever_claims_it(target):
    answers = []
    for n in range(15):  # fifteen addresses, one code
        with client_from(target, f"127.0.1.{n + 1}") as http:
            answers.append(_claim(http, "BBBB-0001").status_code)
    assert answers[:10] == [404] * 10 and set(answers[10:]) == {429}, answers


def test_a_bearer_token_brute_force_is_throttled_and_then_even_the_right_token_waits(target):
    with client_from(target, "127.0.0.5") as http:
        guesses = [http.get("/api/v1/devices", headers={"Authorization": f"Bearer tapi_guess{n}"})
                   for n in range(40)]
        statuses = [g.status_code for g in guesses]
        assert statuses[:30] == [401] * 30 and set(statuses[30:]) == {429}, statuses  # auth_failure_burst: 30
        assert int(guesses[-1].headers["retry-after"]) >= 1 and error_of(guesses[-1].content)
        # a right guess now cannot be told from a wrong one
        assert http.get("/api/v1/devices", headers=target.auth).status_code == 429
        # a dashboard login from there waits too
        assert http.post("/web/login", json={"token": target.api_token}).status_code == 429
        # what carries no credential is not held up
        assert http.get("/api/v1/health").status_code == 200
    assert target.http.get("/api/v1/devices", headers=target.auth).status_code == 200  # other addresses are not


def test_device_token_guesses_at_the_aip_handshake_are_throttled(target):
    statuses = []
    for n in range(35):
        with connect_from("127.0.0.6", target.port) as sock:
            sock.sendall(upgrade_request(target.port, headers={"Authorization": f"Bearer tdev_guess{n}"}))
            statuses.append(read_response(sock)[0])
    assert statuses[:30] == [401] * 30 and set(statuses[30:]) == {429}, statuses


def test_dashboard_login_guesses_are_throttled(target):
    with client_from(target, "127.0.0.8") as http:
        statuses = [http.post("/web/login", json={"token": f"tapi_guess{n}"}).status_code for n in range(35)]
    assert statuses[:30] == [401] * 30 and set(statuses[30:]) == {429}, statuses


# -- Origin --------------------------------------------------------------------------------------


def test_a_page_on_another_port_of_the_same_host_is_refused(target):
    for origin in (f"http://127.0.0.1:{target.port + 1}", f"http://localhost:{target.port + 1}",
                   "http://127.0.0.1", f"https://127.0.0.1:{target.port}"):
        answer = target.http.get("/api/v1/devices", headers={**target.auth, "Origin": origin})
        assert answer.status_code == 403 and "Origin" in error_of(answer.content), origin
        with connect_raw(target.port) as sock:
            sock.sendall(upgrade_request(target.port, headers={"Authorization": f"Bearer {target.device_token}",
                                                               "Origin": origin}))
            assert read_response(sock)[0] == 403, origin
    for origin in (f"http://127.0.0.1:{target.port}", f"http://localhost:{target.port}/"):
        answer = target.http.get("/api/v1/devices", headers={**target.auth, "Origin": origin})
        assert answer.status_code == 200, origin


def test_an_allowed_origin_passes_on_its_own_port_only(tmp_path):
    server = Target(tmp_path, "--allowed-origin", "http://dash.example:8080")
    try:
        for origin, status in (("http://dash.example:8080", 200), ("http://dash.example:8081", 403),
                               ("https://dash.example:8080", 403)):
            answer = server.http.get("/api/v1/devices", headers={**server.auth, "Origin": origin})
            assert answer.status_code == status, (origin, answer.text)
    finally:
        server.close()


# -- what a terminal shows -----------------------------------------------------------------------

# an ESC sequence that clears the screen, one that sets the window title, a carriage return that would
# overwrite the line, a C1 CSI, and a right-to-left override that shows "exe.txt" for "txt.exe"
HOSTILE = "ok\x1b[2J\x1b]0;owned\x07\r\x9b31m\u202etxt.exe"
SHOWN = ("\\x1b[2J", "\\x1b]0;owned\\x07", "\\r", "\\x9b31m", "\\u202etxt.exe")


def tether_cli(*args: str, target: Target | None = None, state: Path | None = None) -> str:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "400", "TETHER_STATE_DIR": str(state or target.state)}
    if target is not None:
        env |= {"TETHER_SERVER": target.base, "TETHER_TOKEN": target.api_token}
    done = subprocess.run([*CLI, *args], capture_output=True, env=env, timeout=120)
    return (done.stdout + done.stderr).decode("utf-8", "replace")  # bytes: a text pipe would turn \r into \n


def assert_shown_escaped(output: str) -> None:
    raw = [c for c in ("\x1b", "\x07", "\r", "\x9b", "\u202e") if c in output]
    assert not raw, f"raw control characters {raw!r} reached the terminal: {output!r}"
    for text in SHOWN:
        assert text in output, (text, output)


def test_a_pairing_request_s_escapes_are_shown_not_obeyed_in_devices_pending(target):
    # a hostile name is refused when the device asks (a device name is letters, digits and - _ .), and its
    # refusal names it escaped; the platform is free text, so it reaches `devices pending` to be shown escaped
    refused = target.http.post("/api/v1/pairing", json={"public_key": DeviceKey.generate().public_key,
                                                        "name": HOSTILE, "platform": "linux"})
    assert refused.status_code == 422 and "not a device name" in refused.json()["error"], refused.text
    asked = target.http.post("/api/v1/pairing", json={"public_key": DeviceKey.generate().public_key, "name": "edge1",
                                                      "platform": "linux\x1b[8m" + HOSTILE})
    assert asked.status_code == 201, asked.text
    output = tether_cli("devices", "pending", target=target)
    assert asked.json()["code"] in output
    assert_shown_escaped(output)
    assert "\x1b" not in target.log() and "\u202e" not in target.log()  # nor in a line of the server's log


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A server with a real device, `alpha`, connected."""
    cluster = Cluster(tmp_path_factory.mktemp("edge-fleet"))
    try:
        cluster.wait_online("alpha", cluster.device("alpha"))
        yield cluster
    finally:
        cluster.close()


def fleet_cli(fleet: Cluster, *args: str) -> str:
    env = {**fleet.env, "NO_COLOR": "1", "COLUMNS": "400", "TETHER_SERVER": f"http://127.0.0.1:{fleet.port}",
           "TETHER_TOKEN": fleet.api_token}
    done = subprocess.run([*CLI, *args], capture_output=True, env=env, timeout=120)
    return (done.stdout + done.stderr).decode("utf-8", "replace")


def test_a_plan_s_and_a_device_s_escapes_are_shown_not_obeyed_in_tasks_log_audit_and_exec(fleet):
    """The request and the plan come from a requester, the output from the device: `tether tasks`,
    `tether log`, `tether audit` and `tether exec --device` show each escape, and obey none."""
    with httpx.Client(base_url=f"http://127.0.0.1:{fleet.port}", timeout=30,
                      headers={"Authorization": f"Bearer {fleet.api_token}"}) as http:
        made = http.post("/api/v1/tasks", json={"request": HOSTILE, "device": "alpha", "plan": [
            {"skill": "shell.run", "args": {"cmd": "printf", "argv": ["%s", HOSTILE], "cwd": "~"},
             "description": HOSTILE}]})
        assert made.status_code in (200, 201, 202), made.text
        task_id = made.json()["id"]
        ended = ("done", "failed", "waiting_for_user")
        wait_for(lambda: http.get(f"/api/v1/tasks/{task_id}").json()["state"] in ended, "the task to end")
    listing = fleet_cli(fleet, "tasks")
    assert task_id[:12] in listing
    assert_shown_escaped(listing)
    log = fleet_cli(fleet, "log", task_id)
    assert "shell.run" in log
    assert_shown_escaped(log)
    audit = fleet_cli(fleet, "audit")  # the arguments are stored as JSON: escaped as \u001b, not \x1b
    assert "shell.run" in audit and "owned" in audit
    assert not [c for c in ("\x1b", "\x07", "\r", "\x9b", "\u202e") if c in audit], audit
    output = fleet_cli(fleet, "exec", "shell.run", "cmd=printf", "argv=" + json.dumps(["%s", HOSTILE]), "cwd=~",
                       "--device", "alpha")
    assert "success" in output
    assert_shown_escaped(output)


def test_a_command_s_output_is_shown_escaped_by_tether_exec_and_as_it_is_with_raw(tmp_path):
    args = ("exec", "shell.run", "cmd=printf", "argv=[" + json.dumps("%s\n\tnext") + ", " + json.dumps(HOSTILE) + "]",
            "cwd=~")
    output = tether_cli(*args, state=tmp_path / "state")
    assert "success" in output and "next" in output, output
    assert_shown_escaped(output)
    raw = tether_cli(*args, "--raw", state=tmp_path / "state")
    assert HOSTILE in raw and "\n\tnext" in raw, raw
