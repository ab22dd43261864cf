"""Outcomes are facts (issue 28, docs/outcomes.md): a result that comes back after its caller stopped
waiting — the caller's timeout, the grace period over, the device's link stalled — is still recorded,
and the caller was told "outcome pending" with where to look, never "failure", while the command may
have been running. Real server and device processes, a `FaultProxy` between them, commands counted
from the file they append to, the audit and `GET /batches/{id}` read back."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests.kits.chaos import WAIT, ChaosCluster, Ledger, Runs, check_invariants
from tests.kits.faultproxy import FaultProxy
from tests.kits.netutil import CLI, wait_for
from tether.client.rest import RemoteError
from tether.protocol.models import Result, ResultStatus
from tether.server.store.audit import LATE_NOTE


def _settled(cluster: ChaosCluster, batch_id: str) -> dict[str, Any]:
    """The batch's record once no outcome in it is open any more (the device's late result came)."""
    record: dict[str, Any] = {}

    def done() -> bool:
        record.update(cluster.remote.batch(batch_id))
        return record["state"] == "done"

    wait_for(done, f"batch {batch_id} settled", WAIT, (cluster.server.popen,))
    return record


def _pending(result: Result, why: str) -> str:
    """The batch id a pending answer names; it says why the wait ended and where to look."""
    assert result.outcome_pending and result.status is ResultStatus.NONE, result
    assert result.error is not None and result.error.startswith("outcome pending:") and why in result.error, result
    batch_id = result.result["batch_id"]
    assert f"tether batch {batch_id}" in result.error and f"/batches/{batch_id}" in result.error, result.error
    assert result.result["call_id"] == result.call_id and result.result["device"] == "alpha"
    return batch_id


def _late_success(cluster: ChaosCluster, batch_id: str, call_id: str) -> None:
    record = _settled(cluster, batch_id)
    [command] = record["commands"]
    assert command["call_id"] == call_id and command["status"] == "success" and command["late"], record
    [row] = [r for r in cluster.audit() if r["call_id"] == call_id]
    assert row["status"] == "success" and row["error"].startswith(LATE_NOTE), row


def test_a_result_after_the_callers_timeout_and_the_grace_period_is_recorded(
        cluster: ChaosCluster, runs: Runs, ledger: Ledger, callers) -> None:
    """The command finishes in time on the device, but its result is swallowed by a stalled link: the
    caller's 3 s timeout passes (its answer: outcome pending), then the device's grace period (a second
    batch queued for it is given up), and only then does the link heal and the result arrive."""
    with FaultProxy(cluster.port) as proxy:
        cluster.device("alpha", runs, port=proxy.port)
        call = callers.submit(cluster.run, "alpha", [runs.command("late", gated=True)], ["late"], ledger,
                              timeout=3.0)
        runs.wait_started("late")
        proxy.black_hole(live=True, new=True)  # the link stalls: nothing passes either way, nothing closes
        assert runs.open_gate("late")  # it ends well inside its timeout; its result goes into the hole
        [result] = call.result(WAIT)
        batch_id = _pending(result, "timed out after 3s")
        # the server drops the silent device, then gives it up after the grace period: a batch queued for
        # it meanwhile (never sent) fails then, and that answer is the event that says the grace is over
        wait_for(lambda: cluster.status("alpha") == "offline", "alpha offline", WAIT, (cluster.server.popen,))
        [queued] = cluster.run("alpha", [runs.command("never")], ["never"], ledger, timeout=WAIT) or [None]
        assert queued is not None and queued.status is ResultStatus.FAILURE, queued
        assert "did not come back within the 3s grace period" in (queued.error or ""), queued
        assert cluster.remote.batch(batch_id)["state"] == "pending"
        shown = subprocess.run([*CLI, "batch", batch_id, "--server", cluster.url, "--token", cluster.api_token],
                               capture_output=True, text=True, timeout=WAIT, env=cluster.env)
        assert shown.returncode == 3 and "pending" in shown.stdout, shown  # a person must look again later
        proxy.heal()  # the device reconnects (not resumed: the server gave it up) and sends what it still owes
        _late_success(cluster, batch_id, "call-late")
    assert runs.counts() == {"late": 1}  # "never" never ran
    check_invariants(cluster, runs, ledger)


def test_a_link_stall_during_a_command_is_pending_not_failure(cluster: ChaosCluster, runs: Runs, ledger: Ledger,
                                                              callers) -> None:
    """The link stalls mid-command for longer than the grace period: the caller (waiting up to 30 s) is
    told "outcome pending" when the grace ends, not "failure"; the second command of the batch, which
    the device runs after the first, and the first are both recorded when the link heals."""
    with FaultProxy(cluster.port) as proxy:
        cluster.device("alpha", runs, port=proxy.port)
        call = callers.submit(cluster.run, "alpha", [runs.command("s1", gated=True), runs.command("s2")],
                              ["s1", "s2"], ledger, timeout=WAIT)
        runs.wait_started("s1")
        proxy.black_hole(live=True, new=True)
        assert runs.open_gate("s1")
        runs.wait_started("s2")  # the device goes on with the batch; both results go into the hole
        first, second = call.result(WAIT)
        batch_id = _pending(first, "did not come back within the 3s grace period")
        assert _pending(second, "grace period") == batch_id
        proxy.heal()
        record = _settled(cluster, batch_id)
        assert [(c["call_id"], c["status"], c["late"]) for c in record["commands"]] == [
            ("call-s1", "success", True), ("call-s2", "success", True)], record
    assert runs.counts() == {"s1": 1, "s2": 1}
    check_invariants(cluster, runs, ledger)


def test_a_timeout_without_a_fault_ends_pending_then_settles_as_what_happened(
        cluster: ChaosCluster, runs: Runs, ledger: Ledger) -> None:
    """No fault at all: the command outlives its timeout, the device stops it. The caller hears either
    the device's own timeout failure or "outcome pending" (whichever clock fired first); a pending one
    is settled by the device's answer, a failure saying it was stopped, and nothing ran twice."""
    cluster.device("alpha", runs)
    [result] = cluster.run("alpha", [runs.command("slow", gated=True)], ["slow"], ledger, timeout=1.0) or [None]
    assert result is not None and result.status is not ResultStatus.SUCCESS, result
    if result.outcome_pending:
        record = _settled(cluster, _pending(result, "timed out after 1s"))
        [command] = record["commands"]
        assert command["status"] == "failure" and command["late"], record
    else:
        assert result.status is ResultStatus.FAILURE and "timed out" in (result.error or ""), result
    assert runs.counts() == {"slow": 1} and not runs.open_gate("slow")  # it is not running any more
    check_invariants(cluster, runs, ledger)
    # the record is its caller's (and an admin's): another token is told there is no such batch
    [row] = [r for r in cluster.audit() if r["call_id"] == "call-slow"]
    assert _settled(cluster, row["response_id"])["requested_by"] == "api:chaos"
    shown = subprocess.run([*CLI, "batch", row["response_id"], "--server", cluster.url, "--token", cluster.api_token],
                           capture_output=True, text=True, timeout=WAIT, env=cluster.env)
    assert shown.returncode == 0 and "done" in shown.stdout and "call-slow" in shown.stdout, shown
    with cluster.client(cluster.other_token) as other, pytest.raises(RemoteError, match="no batch"):
        other.batch(row["response_id"])
    with cluster.client(cluster.other_token) as other, pytest.raises(RemoteError, match="no batch"):
        other.batch("0" * 32)
