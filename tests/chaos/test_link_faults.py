"""The device's link cut, black-holed and slowed (a `FaultProxy` between real device and server
processes) mid-command and mid-reconnect: every result reaches its own caller exactly once, or that
caller gets a clear failure; nothing runs twice."""

from __future__ import annotations

from tests.kits.chaos import WAIT, ChaosCluster, Ledger, Runs, check_invariants
from tests.kits.faultproxy import FaultProxy


def test_link_cut_mid_command_two_devices_two_callers(cluster: ChaosCluster, runs: Runs, ledger: Ledger,
                                                      callers) -> None:
    with FaultProxy(cluster.port) as proxy:
        cluster.device("alpha", runs, port=proxy.port)
        cluster.device("beta", runs, port=proxy.port)
        mine = callers.submit(cluster.run, "alpha", [runs.command("c-alpha", gated=True), runs.command("c-alpha2")],
                              ["c-alpha", "c-alpha2"], ledger)
        theirs = callers.submit(cluster.run, "beta", [runs.command("c-beta", gated=True)], ["c-beta"], ledger,
                                token=cluster.other_token)
        runs.wait_started("c-alpha")
        runs.wait_started("c-beta")
        accepted = proxy.accepted
        proxy.cut()
        proxy.wait_accepted(accepted + 2)  # both devices are reconnecting
        assert runs.open_gate("c-beta") and runs.open_gate("c-alpha")
        assert [r.ok for r in mine.result(WAIT)] == [True, True], ledger.sent
        assert [r.ok for r in theirs.result(WAIT)] == [True], ledger.sent
    assert runs.counts() == {"c-alpha": 1, "c-alpha2": 1, "c-beta": 1}
    check_invariants(cluster, runs, ledger)


def test_link_black_holed_mid_command(cluster: ChaosCluster, runs: Runs, ledger: Ledger, callers) -> None:
    """The result is written into a link that swallows it and never closes: the device must notice the
    silence, reconnect, and the result must still arrive (from the device's record, not a second run)."""
    with FaultProxy(cluster.port) as proxy:
        cluster.device("alpha", runs, port=proxy.port)
        call = callers.submit(cluster.run, "alpha", [runs.command("h1", gated=True), runs.command("h2")],
                              ["h1", "h2"], ledger)
        runs.wait_started("h1")
        accepted = proxy.accepted
        proxy.black_hole(live=True, new=False)
        assert runs.open_gate("h1")  # its result goes into the black hole
        proxy.wait_accepted(accepted + 1)  # the device gave up on the silent link
        results = call.result(WAIT)
        assert [r.ok for r in results] == [True, True], results
    assert runs.counts() == {"h1": 1, "h2": 1}
    check_invariants(cluster, runs, ledger)


def test_link_black_holed_mid_reconnect(cluster: ChaosCluster, runs: Runs, ledger: Ledger, callers) -> None:
    """The link drops and the device's next connection attempt hangs in a black hole; the link comes
    back inside the server's grace period and the device must not stay stuck on that attempt."""
    with FaultProxy(cluster.port) as proxy:
        cluster.device("alpha", runs, port=proxy.port)
        call = callers.submit(cluster.run, "alpha", [runs.command("j1", gated=True)], ["j1"], ledger)
        runs.wait_started("j1")
        accepted = proxy.accepted
        proxy.black_hole(live=False, new=True)
        proxy.cut()
        assert runs.open_gate("j1")  # the result waits in the device's outbox
        proxy.wait_accepted(accepted + 1)  # an attempt is stuck in the hole
        proxy.heal()
        [result] = call.result(WAIT)
        assert result.ok, result  # the link was back 0 s into a 3 s grace period
    assert runs.counts() == {"j1": 1}
    check_invariants(cluster, runs, ledger)


def test_link_reset_mid_registration(cluster: ChaosCluster, runs: Runs, ledger: Ledger, callers) -> None:
    with FaultProxy(cluster.port) as proxy:
        cluster.device("alpha", runs, port=proxy.port)
        call = callers.submit(cluster.run, "alpha", [runs.command("g1", gated=True)], ["g1"], ledger)
        runs.wait_started("g1")
        accepted = proxy.accepted
        proxy.cut_new_after(600, count=2)  # the next two attempts are reset halfway through registering
        proxy.cut()
        assert runs.open_gate("g1")
        proxy.wait_accepted(accepted + 3)
        [result] = call.result(WAIT)
        assert result.ok, result
    assert runs.counts() == {"g1": 1}
    check_invariants(cluster, runs, ledger)


def test_link_slowed_mid_command(cluster: ChaosCluster, runs: Runs, ledger: Ledger, callers) -> None:
    """A slow link (0.4 s each way, 16 KB/s) under two callers: slower answers, the same answers."""
    with FaultProxy(cluster.port) as proxy:
        cluster.device("alpha", runs, port=proxy.port)
        cluster.device("beta", runs, port=proxy.port)
        accepted = proxy.accepted
        first = callers.submit(cluster.run, "alpha", [runs.command("s1", gated=True), runs.command("s2")],
                               ["s1", "s2"], ledger)
        second = callers.submit(cluster.run, "beta", [runs.command("s3", gated=True), runs.command("s4")],
                                ["s3", "s4"], ledger, token=cluster.other_token)
        runs.wait_started("s1")
        runs.wait_started("s3")
        proxy.slow(latency=0.4, rate=16_000)
        assert runs.open_gate("s1") and runs.open_gate("s3")
        assert [r.ok for r in first.result(WAIT)] == [True, True], ledger.sent
        assert [r.ok for r in second.result(WAIT)] == [True, True], ledger.sent
        more = cluster.run("alpha", [runs.command("s5")], ["s5"], ledger)
        assert more is not None and more[0].ok, more
        assert proxy.accepted == accepted, "a slow link is not a dead one: nobody reconnected"
    assert runs.counts() == {"s1": 1, "s2": 1, "s3": 1, "s4": 1, "s5": 1}
    check_invariants(cluster, runs, ledger)
