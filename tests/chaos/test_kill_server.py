"""kill -9 of the real `tether server` process mid-batch, mid-task and mid-reconnect, then a restart on
the same port and database.

Callers whose server died get a clear error (the HTTP stream breaks), nothing runs twice (the device
never re-runs what the new server cannot know about, the restarted task asks before running a step
again), tasks end up in a clear state and the audit lists every command that was sent."""

from __future__ import annotations

import pytest

from tests.kits.chaos import WAIT, ChaosCluster, Ledger, Runs, check_invariants
from tests.kits.faultproxy import FaultProxy
from tests.kits.netutil import wait_for
from tether.device.link.settings import LinkSettings

# After the heal the device may, by its own schedule, still be inside one attempt the black hole swallowed
# (the restarted server listens before it opens its database, so the proxy's connections upstream succeed
# and the device's handshake goes nowhere until its connect timeout), then in one backoff wait (at most
# the cap; the grace window's attempts do not raise the step, so after a short outage it is far less): a
# fair bound is both, plus the registration under load. A device that never retries still fails it.
_LINK = LinkSettings()
HEALED_WAIT = _LINK.connect_timeout + _LINK.backoff_cap + 20.0


def test_server_killed_mid_batch(cluster: ChaosCluster, runs: Runs, ledger: Ledger, callers) -> None:
    cluster.device("alpha", runs)
    labels = ["b1", "b2", "b3"]
    batch = [runs.command("b1"), runs.command("b2", gated=True), runs.command("b3")]
    call = callers.submit(cluster.run, "alpha", batch, labels, ledger)
    runs.wait_started("b2")
    cluster.kill_server()
    assert call.result(WAIT) is None  # the caller's stream broke: a clear RemoteError, recorded
    assert "lost the connection" in ledger.sent[0].caller_error or "closed the stream" in ledger.sent[0].caller_error
    cluster.restart_server()
    cluster.wait_online("alpha")
    runs.open_gate("b2")  # the orphaned command may still run on the device; it ends either way
    after = cluster.run("alpha", [runs.command("b4")], ["b4"], ledger)
    assert after is not None and after[0].ok, after
    counts = runs.counts()
    assert counts["b1"] == counts["b2"] == counts["b4"] == 1 and counts["b3"] <= 1, counts
    check_invariants(cluster, runs, ledger)


def test_server_killed_mid_task(cluster: ChaosCluster, runs: Runs, ledger: Ledger) -> None:
    cluster.device("alpha", runs)
    plan = [runs.step("t1"), runs.step("t2", gated=True), runs.step("t3")]
    created = cluster.remote.create_task("three counted steps", plan=plan, device="alpha")
    tid = created["id"]
    runs.wait_started("t2")
    cluster.kill_server()
    cluster.restart_server()
    cluster.wait_online("alpha")
    # the restarted server asks the device about the step first (it stopped the orphaned run on reconnecting,
    # so the device reports a failure it cannot vouch for): then the person is asked
    wait_for(lambda: cluster.remote.task(tid)["state"] != "running", "the task settled", WAIT)
    task = cluster.remote.task(tid)
    assert task["state"] == "waiting_for_user", task["state"]
    question = task["questions"][-1]
    assert question["kind"] == "restart" and question["options"] == ["retry", "skip this step", "cancel"]
    runs.open_gate("t2")  # the orphan ends; the step it ran is not run again unless a person says retry
    cluster.remote.answer(tid, "skip")
    end = [data for kind, data in cluster.remote.task_events(tid) if kind == "end"]
    assert end and end[-1]["state"] == "done", end
    assert runs.counts() == {"t1": 1, "t2": 1, "t3": 1}
    check_invariants(cluster, runs, ledger)


@pytest.mark.parametrize("fault", ["black-holed", "reset mid-registration"])
def test_server_killed_while_the_device_reconnects(cluster: ChaosCluster, runs: Runs, ledger: Ledger, callers,
                                                   fault: str) -> None:
    with FaultProxy(cluster.port) as proxy:
        cluster.device("alpha", runs, port=proxy.port)
        call = callers.submit(cluster.run, "alpha", [runs.command("x1", gated=True)], ["x1"], ledger)
        runs.wait_started("x1")
        accepted = proxy.accepted
        if fault == "black-holed":
            proxy.black_hole()  # the live link and the reconnection attempts: swallowed
        else:
            proxy.cut_new_after(600, count=50)  # every attempt reset while it registers
        proxy.cut()
        proxy.wait_accepted(accepted + 1)  # a reconnection attempt is under way
        cluster.kill_server()
        assert call.result(WAIT) is None
        runs.open_gate("x1")  # its result waits in the device's outbox for a server that never sent it
        cluster.restart_server()
        proxy.heal()
        cluster.wait_online("alpha", HEALED_WAIT)
        after = cluster.run("alpha", [runs.command("x2")], ["x2"], ledger)
        assert after is not None and after[0].ok, after
    assert runs.counts() == {"x1": 1, "x2": 1}
    check_invariants(cluster, runs, ledger)
