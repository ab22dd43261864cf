"""Stopping the server while a client follows a task (issue 12 §2): both ends stop cleanly, no
CancelledError traceback on either side, and the client says the server went away."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.kits.netutil import CLI, Cluster


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
        env = {**cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{cluster.port}",
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
