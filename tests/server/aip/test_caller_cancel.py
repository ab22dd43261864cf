"""A REST caller that goes away cancels its batch; every caller learns the batch id at once.

Real `tether server` and `tether device` processes: a plain JSON POST whose client disconnects while
its command runs gets that command's process killed on the device, the device free for the next
command at once, and an audit row that says the batch was cancelled (it used to run on and be
audited as a success 20 s later). The batch id comes back before any result, as the `X-Tether-Batch`
header and in the first SSE event, so `DELETE /api/v1/batches/{id}` can stop it.
"""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.kits.netutil import Cluster, wait_for
from tether.protocol.models import Command, ResultStatus


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def shell(cmd: str, argv: list[str], cwd: Path) -> Command:
    return Command(tool_name="shell.run", parameters={"cmd": cmd, "argv": argv, "cwd": str(cwd)})


def _sleeper(device_pid: int) -> psutil.Process | None:
    try:
        return next((p for p in psutil.Process(device_pid).children(recursive=True) if p.name() == "sleep"), None)
    except psutil.NoSuchProcess:
        return None


def _post(cluster: Cluster, command: Command, timeout: float = 120) -> http.client.HTTPConnection:
    """A plain JSON POST (no SSE) of one command to alpha, sent but not yet answered."""
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=30)
    body = json.dumps({"commands": [command.model_dump(exclude_none=True)], "timeout": timeout})
    conn.request("POST", "/api/v1/devices/alpha/commands", body=body,
                 headers={"Authorization": f"Bearer {cluster.api_token}", "Content-Type": "application/json"})
    return conn


def _audit_row(cluster: Cluster, call_id: str) -> dict:
    def row():
        return next((r for r in cluster.remote._request("GET", "/audit", params={"limit": 500})["rows"]
                     if r["call_id"] == call_id), None)
    return wait_for(row, f"the audit row of {call_id}", 30)  # type: ignore[return-value]


def _assert_device_free(cluster: Cluster, tmp_path: Path) -> None:
    started = time.monotonic()
    _, [result] = cluster.remote.run("alpha", [shell("echo", ["next"], tmp_path)], timeout=20)
    elapsed = time.monotonic() - started
    assert result.ok and result.result["stdout"] == "next\n", result
    assert elapsed < 5, f"the next command waited {elapsed:.1f}s behind the cancelled one"


def test_a_plain_post_whose_caller_disconnects_is_cancelled_on_the_device(cluster, tmp_path):
    alpha = cluster.device("alpha")
    cluster.wait_online("alpha", alpha)
    cmd = shell("sleep", ["60"], tmp_path)
    conn = _post(cluster, cmd)
    response = conn.getresponse()  # the headers come at once, long before the command ends
    batch = response.getheader("X-Tether-Batch")
    assert response.status == 200 and batch and len(batch) == 32
    sleeper = wait_for(lambda: _sleeper(alpha.pid), "sleep started on the device", 30, (alpha.popen,))
    assert isinstance(sleeper, psutil.Process)
    response.close()  # the client gives up (a client timeout, a closed laptop): the socket closes
    conn.close()
    sleeper.wait(timeout=15)  # raises psutil.TimeoutExpired when the command was left running
    _assert_device_free(cluster, tmp_path)
    row = _audit_row(cluster, cmd.call_id)
    assert row["status"] == "failure" and "disconnected" in row["error"] and "cancel" in row["error"], row
    assert row["response_id"] == batch


def test_the_batch_header_lets_another_request_cancel_a_plain_post(cluster, tmp_path):
    alpha = cluster.device("alpha")
    cluster.wait_online("alpha", alpha)
    cmd = shell("sleep", ["60"], tmp_path)
    conn = _post(cluster, cmd)
    response = conn.getresponse()
    batch = response.getheader("X-Tether-Batch")
    sleeper = wait_for(lambda: _sleeper(alpha.pid), "sleep started on the device", 30, (alpha.popen,))
    assert isinstance(sleeper, psutil.Process)
    cancelled = cluster.remote._request("DELETE", f"/batches/{batch}")
    assert cancelled == {"cancelled": batch}
    body = json.loads(response.read())  # the waiting caller gets its answer: the command was cancelled
    conn.close()
    [result] = body["results"]
    assert body["device"] == "alpha" and result["call_id"] == cmd.call_id
    assert result["status"] == ResultStatus.FAILURE.value and "cancelled by api:tests" in result["error"]
    sleeper.wait(timeout=15)
    _assert_device_free(cluster, tmp_path)
    row = _audit_row(cluster, cmd.call_id)
    assert row["status"] == "failure" and "cancelled by api:tests" in row["error"], row
    with pytest.raises(Exception, match="no batch"):  # it is over: nothing left to cancel
        cluster.remote._request("DELETE", f"/batches/{batch}")


def test_the_first_sse_event_names_the_batch_and_delete_cancels_it(cluster, tmp_path):
    alpha = cluster.device("alpha")
    cluster.wait_online("alpha", alpha)
    cmd = shell("sleep", ["60"], tmp_path)
    body = {"commands": [cmd.model_dump(exclude_none=True)], "timeout": 120}
    headers = {"Authorization": f"Bearer {cluster.api_token}", "Accept": "text/event-stream"}
    with httpx.Client(base_url=f"http://127.0.0.1:{cluster.port}", timeout=30) as http, \
            http.stream("POST", "/api/v1/devices/alpha/commands", json=body, headers=headers) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: device"
        first = json.loads(next(lines).removeprefix("data: "))
        assert first["device"] == "alpha" and first["batch"] == response.headers["X-Tether-Batch"]
        sleeper = wait_for(lambda: _sleeper(alpha.pid), "sleep started on the device", 30, (alpha.popen,))
        assert isinstance(sleeper, psutil.Process)
        assert cluster.remote._request("DELETE", f"/batches/{first['batch']}") == {"cancelled": first["batch"]}
        rest = list(lines)
    results = json.loads(rest[rest.index("event: results") + 1].removeprefix("data: "))
    [result] = results["results"]
    assert result["status"] == "failure" and "cancelled" in result["error"]
    sleeper.wait(timeout=15)
    _assert_device_free(cluster, tmp_path)
