"""kill -9 of a real `tether device` process mid-command, mid-batch and mid-reconnect.

The caller gets a clear failure, or "outcome pending" while the server cannot know the process died,
for what the dead process cannot answer (never a hang), what had
finished before the kill is delivered, the restarted device runs none of it again, and the audit has
a row for every command."""

from __future__ import annotations

from tests.kits.chaos import WAIT, ChaosCluster, Ledger, Runs, check_invariants, child_gone, pids_running
from tests.kits.faultproxy import FaultProxy
from tether.protocol.models import ResultStatus


def test_device_killed_mid_command_and_restarted_at_once(cluster: ChaosCluster, runs: Runs, ledger: Ledger,
                                                         callers) -> None:
    alpha = cluster.device("alpha", runs)
    batch = [runs.command("k1", gated=True), runs.command("k2")]
    call = callers.submit(cluster.run, "alpha", batch, ["k1", "k2"], ledger)
    runs.wait_started("k1")
    alpha.kill()
    for pid in pids_running(runs.script, "k1"):  # the sandboxed command dies with its device
        assert child_gone(pid), f"k1 (pid {pid}) outlived its killed device"
    cluster.device("alpha", runs)  # back inside the grace period, as a new process
    results = call.result(WAIT)
    # "restarted; outcome unknown" when the new process registered within the grace period; when it took
    # longer, the grace ended first, and then the server could only say the outcome was pending
    assert all(r.status is ResultStatus.FAILURE or r.outcome_pending for r in results), results
    assert "restarted" in results[0].error or "disconnected" in results[0].error, results[0].error
    assert not runs.open_gate("k1")
    again = cluster.run("alpha", [runs.command("k3")], ["k3"], ledger)
    assert again is not None and again[0].ok, again
    assert runs.counts() == {"k1": 1, "k3": 1}
    check_invariants(cluster, runs, ledger)


def test_device_killed_mid_batch_stays_dead_past_the_grace(cluster: ChaosCluster, runs: Runs, ledger: Ledger,
                                                           callers) -> None:
    alpha = cluster.device("alpha", runs)
    labels = ["m1", "m2", "m3"]
    batch = [runs.command("m1"), runs.command("m2", gated=True), runs.command("m3")]
    call = callers.submit(cluster.run, "alpha", batch, labels, ledger)
    runs.wait_started("m2")
    alpha.kill()
    results = call.result(WAIT)  # the grace period (3 s) ends; no hang
    # the server cannot know the device died: m2 and m3 were sent and may still run (docs/outcomes.md)
    assert results[0].status is ResultStatus.SUCCESS and results[1].outcome_pending and results[2].outcome_pending
    assert "grace" in results[1].error, results[1].error
    cluster.device("alpha", runs)
    again = cluster.run("alpha", [runs.command("m4")], ["m4"], ledger)
    assert again is not None and again[0].ok, again
    # the new process settled what the old one left pending: those outcomes will never come
    rows = {r["call_id"]: r for r in cluster.audit()}
    for label in ("m2", "m3"):
        row = rows[f"call-{label}"]
        assert row["status"] == "unknown" and "restarted (a new process)" in row["error"], row
    assert runs.counts() == {"m1": 1, "m2": 1, "m4": 1}
    check_invariants(cluster, runs, ledger)


def test_device_killed_mid_reconnect(cluster: ChaosCluster, runs: Runs, ledger: Ledger, callers) -> None:
    with FaultProxy(cluster.port) as proxy:
        alpha = cluster.device("alpha", runs, port=proxy.port)
        call = callers.submit(cluster.run, "alpha", [runs.command("r1", gated=True)], ["r1"], ledger)
        runs.wait_started("r1")
        accepted = proxy.accepted
        proxy.down()  # the link drops and every reconnection attempt is reset
        proxy.wait_accepted(accepted + 1)  # the device is in its reconnect loop
        alpha.kill()
        proxy.heal()
        cluster.device("alpha", runs, port=proxy.port)
        [result] = call.result(WAIT)
        assert (result.status is ResultStatus.FAILURE or result.outcome_pending) and result.error, result
        again = cluster.run("alpha", [runs.command("r2")], ["r2"], ledger)
        assert again is not None and again[0].ok, again
    assert runs.counts() == {"r1": 1, "r2": 1}
    check_invariants(cluster, runs, ledger)
