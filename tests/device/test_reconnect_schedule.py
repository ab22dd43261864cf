"""The device's reconnect schedule (`reconnect.Backoff`) as a fleet operator sees it, run as a pure function of
the attempts, the grace window and a seeded random (no clock, no sockets): a short outage is followed by a quick
reconnect; the dense attempts of a grace window do not raise the step, so the backoff after the window starts
from its first step; a long outage still backs off to the cap; a link must stay up to reset the step; a fleet
that lost its server at once comes back spread out. `tests/chaos/test_reconnect_pacing.py` runs the same
schedule in real `tether device` processes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tether.device.link.reconnect import GRACE_FLOOR_S, GRACE_SHARE, RESTART_SPREAD_S, Backoff, backoff_delay

TOP = 1.0  # rand() at its largest: the upper end of each full-jitter range


def top() -> float:
    return TOP


def outage(backoff: Backoff, grace: float | None, until: float, *, uptime: float = 60.0) -> list[tuple[float, float]]:
    """The attempts of one device whose link (up `uptime` s) dropped at 0 and whose every attempt fails at once,
    until `until` seconds: (time of the wait's start, the wait) for each. `grace`: the server's grace period if the
    device owes it results (None: it owes nothing)."""
    now, waits = 0.0, []
    first = True
    while now < until:
        left = grace - now if grace is not None else None
        wait = backoff.next_wait(uptime=uptime if first else None, round_done=True, grace_left=left)
        first = False
        waits.append((now, wait))
        now += wait
    return waits


def test_after_a_grace_window_the_backoff_starts_from_its_first_step_and_grows_to_the_cap() -> None:
    backoff = Backoff(0.5, 30.0, RESTART_SPREAD_S, 10.0, rand=top)
    waits = outage(backoff, grace=10.0, until=200.0)
    inside = [w for t, w in waits if t < 10.0]
    after = [w for t, w in waits if t >= 10.0]
    # the window's attempts: as dense as before (the spread first, then the exponent grows, each held to a share
    # of what is left of the window, never below the floor), however many
    assert inside[0] == pytest.approx(min(RESTART_SPREAD_S, GRACE_SHARE * 10.0))
    assert len(inside) > 6 and all(w <= max(GRACE_FLOOR_S, GRACE_SHARE * 10.0) for w in inside)
    # ... and the step is where the window found it: after it, 0.5, 1, 2, … up to the cap, and the cap stays
    assert after[:9] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert backoff.step > 9 and backoff.in_window == len(inside)


@pytest.mark.parametrize("seed", range(10))
def test_full_jitter_after_the_window_is_drawn_from_the_growing_ranges(seed: int) -> None:
    rng = random.Random(seed)
    backoff = Backoff(0.5, 30.0, RESTART_SPREAD_S, 10.0, rand=rng.random)
    after = [w for t, w in outage(backoff, grace=3.0, until=120.0) if t >= 3.0]
    bounds = [min(30.0, 0.5 * 2 ** k) for k in range(len(after))]
    assert all(0 <= w <= bound for w, bound in zip(after, bounds, strict=True)), list(zip(after, bounds, strict=True))
    assert len(set(after)) == len(after)  # drawn, not fixed


def test_inside_the_window_the_pacing_is_the_grace_bounded_exponential_of_its_own_count() -> None:
    draws = iter(random.Random(7).random() for _ in range(1000))
    replay = iter(random.Random(7).random() for _ in range(1000))
    backoff = Backoff(0.5, 30.0, RESTART_SPREAD_S, 10.0, rand=lambda: next(draws))
    now, k = 0.0, 0
    while now < 10.0:
        wait = backoff.next_wait(uptime=60.0 if k == 0 else None, round_done=True, grace_left=10.0 - now)
        expected = backoff_delay(k, 0.5, 30.0, lambda: next(replay), grace_left=10.0 - now,
                                 spread=RESTART_SPREAD_S if k == 0 else 0.0)
        assert wait == expected
        assert backoff.step == 0  # never raised inside
        now, k = now + wait, k + 1


def test_a_short_outage_without_a_window_is_followed_by_a_quick_reconnect() -> None:
    backoff = Backoff(0.5, 30.0, RESTART_SPREAD_S, 10.0, rand=top)
    waits = [w for _, w in outage(backoff, grace=None, until=10.0)]
    assert waits[:5] == [RESTART_SPREAD_S, 1, 2, 4, 8]  # the fleet's spread first, then the plain exponential


def test_only_a_link_that_stayed_up_resets_the_step() -> None:
    backoff = Backoff(0.5, 30.0, RESTART_SPREAD_S, 10.0, rand=top)
    outage(backoff, grace=None, until=300.0)  # a long outage: at the cap
    assert backoff.next_wait(uptime=None, round_done=True) == 30.0
    # registered, dropped after 2 s (a server accepting and dropping its devices): still backed off from
    assert backoff.next_wait(uptime=2.0, round_done=True) == 30.0
    # inside that short link's window the attempts are paced by the window, and the step is kept for after it
    assert backoff.next_wait(uptime=2.0, round_done=True, grace_left=10.0) == GRACE_SHARE * 10.0
    assert backoff.next_wait(uptime=None, round_done=True, grace_left=None) == 30.0
    # up for stable_after: the next outage starts over, spread
    assert backoff.next_wait(uptime=10.0, round_done=True) == RESTART_SPREAD_S
    assert backoff.next_wait(uptime=None, round_done=True) == 1.0


def test_a_busy_server_and_an_unfinished_round_of_nodes_do_not_raise_the_step() -> None:
    backoff = Backoff(0.5, 30.0, RESTART_SPREAD_S, 10.0, rand=top)
    assert backoff.next_wait(uptime=None, round_done=True, retry_after=3.0) == 6.0  # its pace: [3, 6]
    assert backoff.next_wait(uptime=None, round_done=False) == 0.5  # the next node of a cluster, at once-ish
    assert backoff.step == 0
    assert backoff.next_wait(uptime=None, round_done=True) == 0.5
    assert backoff.step == 1


def _attempts(fleet: int, grace: float | None, until: float, seed: int) -> list[list[float]]:
    """Each device's attempt times in a fleet whose devices all lost the server at 0."""
    rng = random.Random(seed)
    return [[t + w for t, w in outage(Backoff(0.5, 30.0, RESTART_SPREAD_S, 10.0, rand=rng.random), grace, until)]
            for _ in range(fleet)]


@pytest.mark.parametrize("grace", [None, 10.0])
def test_a_fleet_that_lost_its_server_at_once_comes_back_spread_out(grace: float | None) -> None:
    """1,000 devices lose the server in the same instant (a restart): no 100 ms holds more than twice its even share
    of their first attempts, nor of their first ones drawn after the grace window (which closes in the same instant
    for all of them); a minute into the outage they try about once per 15 s each (the cap's mean)."""
    fleet = 1000
    devices = _attempts(fleet, grace, 60.0, seed=3)
    first_wave = Counter(int(times[0] * 10) for times in devices)
    assert len(first_wave) == 20 and max(first_wave.values()) < 2 * fleet / 20, first_wave.most_common(3)
    if grace is not None:
        # the window's last attempts come within GRACE_FLOOR_S of its end for every device (the window's own
        # pacing); the first wait drawn after it is [0, 0.5], so the next attempts spread over half a second
        past = [[t for t in times if t >= grace] for times in devices]
        assert all(times[0] < grace + GRACE_FLOOR_S for times in past)
        after = Counter(int((times[1] - grace) * 10) for times in past)
        assert max(after.values()) < 2 * fleet / 5, after.most_common(3)
    late = sum(1 for times in devices for t in times if 40.0 <= t < 60.0)
    assert late < fleet * 20.0 / 15.0 * 1.5, late
