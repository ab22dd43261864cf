"""The reconnect schedule in a real `tether device` process against a real `tether server` killed and restarted
on the same port and database (the kit's grace period: 3 s).

The device owes the server a result (a gated command runs) when the server dies, so it retries densely through
the grace window; the window's attempts must not raise its backoff step, so the waits it plans once the window
has closed are drawn from its first steps (0-0.5 s, 0-1 s, 0-2 s), not from the whole 0-30 s range the
window's attempts took it to before. The device logs each planned wait ("reconnecting in 0.31s", with what is
left of the grace period while the window is open): those lines are what is checked, as soon as they appear.
A device whose token is refused stops at once (exit code 3) after its one attempt, never spinning."""

from __future__ import annotations

import re

from tests.kits.chaos import WAIT, ChaosCluster, Ledger, Runs
from tests.kits.netutil import wait_for
from tether.device.link.reconnect import GRACE_FLOOR_S, GRACE_SHARE
from tether.device.link.settings import LinkSettings

PLANNED = re.compile(r"reconnecting in ([0-9.]+)s(?: \(([0-9.]+)s left of the server's grace period\))?")
_LINK = LinkSettings()
ROUNDING = 0.006  # the log prints waits to 1/100 s and what is left to 1/10 s


def planned_waits(log: str) -> tuple[list[tuple[float, float]], list[float]]:
    """The waits a device's log planned after its link was lost: (wait, grace left) inside the window, and after."""
    inside: list[tuple[float, float]] = []
    after: list[float] = []
    for wait, left in PLANNED.findall(log.partition("connection to ")[2]):
        if left:
            inside.append((float(wait), float(left)))
        else:
            after.append(float(wait))
    return inside, after


def test_after_the_grace_window_the_device_backs_off_from_its_first_step(cluster: ChaosCluster, runs: Runs,
                                                                         ledger: Ledger, callers) -> None:
    device = cluster.device("alpha", runs)
    call = callers.submit(cluster.run, "alpha", [runs.command("owed", gated=True)], ["owed"], ledger)
    runs.wait_started("owed")  # the device owes the server this result from now on
    cluster.kill_server()
    bounds = [min(_LINK.backoff_cap, _LINK.backoff_base * 2 ** k) for k in range(3)]

    def three_after_the_window_or_one_too_long() -> tuple[list[tuple[float, float]], list[float]] | None:
        inside, after = planned_waits(device.output())
        if len(after) >= len(bounds) or any(w > b + ROUNDING for w, b in zip(after, bounds, strict=False)):
            return inside, after
        return None

    found = wait_for(three_after_the_window_or_one_too_long, "three waits planned after the grace window", WAIT,
                     (device.popen,))
    assert isinstance(found, tuple)
    inside, after = found
    assert len(inside) >= 2, inside  # the window paced attempts of its own
    for wait, left in inside:
        assert wait <= max(GRACE_FLOOR_S, GRACE_SHARE * (left + 0.05)) + ROUNDING, (wait, left)
    assert all(w <= b + ROUNDING for w, b in zip(after, bounds, strict=False)), \
        f"after the grace window the device planned {after[:3]} s (its first steps allow {bounds} s)"
    cluster.restart_server()
    cluster.wait_online("alpha")  # back within the wait it is in (at most 2 s more here), bounded by WAIT
    assert call.result(WAIT) is None  # its caller saw the server die
    runs.open_gate("owed")

    # a refused token: the device says so and stops after its one attempt (exit code 3), it does not retry
    refused = cluster._start(["device", "--server", f"ws://127.0.0.1:{cluster.port}", "--name", "beta",
                              "--state-dir", str(cluster.tmp / "dev-refused"), "--policy", str(runs.policy)],
                             "device-refused", {"TETHER_DEVICE_TOKEN": "not-a-token-of-this-server"})
    assert refused.popen.wait(timeout=WAIT) == 3
    said = refused.output()
    assert "refused by the server" in said and "reconnecting in" not in said, said
