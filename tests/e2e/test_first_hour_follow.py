"""Stopping the server while a client follows a task (issue 12 §2): both ends stop cleanly, no
CancelledError traceback on either side, and the client says the server went away."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from tests.kits.netutil import CLI, STARTUP_WAIT, Cluster, wait_for


def test_stopping_the_server_under_a_follower_ends_both_cleanly(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        work = tmp_path / "work"
        work.mkdir()
        policy = tmp_path / "policy.yaml"
        policy.write_text(f"read_roots: {json.dumps([str(work)])}\nwrite_roots: {json.dumps([str(work)])}\n")
        alpha = cluster.device("alpha", extra=("--policy", str(policy)))
        cluster.wait_online("alpha", alpha)
        created = cluster.remote.create_task("wait", device="alpha", plan=[
            {"skill": "shell.run", "args": {"cmd": "sleep", "argv": ["120"], "cwd": str(work)}}])
        env = {**cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{cluster.port}", "TETHER_FOLLOW_PATIENCE": "2",
               "TETHER_TOKEN": cluster.api_token, "NO_COLOR": "1", "COLUMNS": "200"}
        follower = subprocess.Popen([*CLI, "log", created["id"], "--follow"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
        try:
            assert follower.stdout is not None
            for line in follower.stdout:  # following: the step runs on the device
                if "▶ step 1" in line:
                    break
            else:
                pytest.fail("the follower never saw the step start: " + (follower.stderr.read() if follower.stderr
                                                                         else ""))
            # uvicorn shuts down, then re-raises the signal it caught: -15 is a clean stop by SIGTERM
            assert cluster.server.stop(timeout=60) in (0, -15)
            rest, err = follower.communicate(timeout=120)
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait()
        server_log = cluster.server.log.read_text(errors="replace")
        assert "Traceback" not in server_log and "CancelledError" not in server_log, server_log
        assert "Traceback" not in rest + err and "CancelledError" not in rest + err, rest + err
        assert follower.returncode == 4, rest + err  # ExitCode.UNREACHABLE: the connection was lost
        assert "error:" in err and "server" in err and f"tether log {created['id']} --follow" in err, err
    finally:
        cluster.close()


def test_a_follower_rides_out_a_server_restart(tmp_path: Path) -> None:
    """The server stops under `tether log --follow` and stays away for more tries than a handful: the follower
    says so once, keeps trying, and after the restart goes on from the last event it showed to the task's end."""
    cluster = Cluster(tmp_path)
    try:
        alpha = cluster.device("alpha")
        cluster.wait_online("alpha", alpha)
        created = cluster.remote.create_task("wait", device="alpha", plan=[
            {"skill": "shell.run", "args": {"cmd": "sleep", "argv": ["120"]}}])
        tid = created["id"]
        env = {**cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{cluster.port}",
               "TETHER_TOKEN": cluster.api_token, "NO_COLOR": "1", "COLUMNS": "200"}
        follower = subprocess.Popen([*CLI, "log", tid, "--follow"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
        shown: list[str] = []
        try:
            assert follower.stdout is not None
            for line in follower.stdout:
                shown.append(line)
                if "▶ step 1" in line:
                    break
            assert cluster.server.stop(timeout=60) in (0, -15)
            # while the server is away its port drops the follower's tries at once; they are counted
            tries = _Refuser(cluster.port)
            try:
                wait_for(lambda: tries.count >= 7 or follower.poll() is not None, "seven tries", 120)
            finally:
                tries.close()
            assert follower.poll() is None, "the follower gave up while the server was away"
            server_args = cluster.server.popen.args[len(CLI):]  # type: ignore[index, arg-type]
            cluster.server = cluster.start(list(server_args), "server")
            wait_for(lambda: cluster.remote.health()["status"] == "ok", "server health", STARTUP_WAIT)
            wait_for(lambda: cluster.remote.task(tid)["state"] == "waiting_for_user", "the restart question", 90)
            cluster.remote.answer(tid, "skip")
            rest, err = follower.communicate(timeout=120)
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait()
        out = "".join(shown) + rest
        assert follower.returncode == 0, out + err
        assert err.count("the server went away; following again when it is back") == 1, err
        assert out.count("▶ step 1") == 1, out  # resumed after the last event shown: nothing twice
        assert "skip" in out and "Traceback" not in out + err, out + err
    finally:
        cluster.close()


class _Refuser:
    """A listener on `port` that closes each connection once it has read its request, counting the requests
    for a task's event stream (the device's own reconnections are not counted)."""

    def __init__(self, port: int) -> None:
        self.count = 0
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self._sock.listen(16)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(10)
                try:
                    head = conn.recv(4096)
                except OSError:
                    continue
            if b"/events" in head.split(b"\r\n", 1)[0]:
                self.count += 1

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(10)
