"""The hub's garbage-collector keeper (server/aip/fleet/gc_keeper.py): a large fleet's connections are frozen out of
full collections, frozen again as the fleet grows, and unfrozen (for one full collection) when it shrinks
or the refresh period has passed, so that what departed devices left behind is reclaimed. Stepped by
hand (`GcKeeper.tick`), no clock involved; each test leaves the interpreter unfrozen."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from tether.server.aip.fleet.gc_keeper import GcKeeper, keep_gc_lean, young_threshold
from tether.server.main import freeze_once_started


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    thresholds = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_a_frozen_fleet_collects_its_young_generation_less_often_and_a_thaw_restores_the_default() -> None:
    default = gc.get_threshold()
    keeper = GcKeeper(from_devices=10, refresh_s=1e9)
    assert keeper.tick(2_000, 0.0) == "freeze"
    assert gc.get_threshold() == (young_threshold(2_000, default[0]), *default[1:]) == (20_000, *default[1:])
    assert keeper.tick(1_000, 1.0) == "unfreeze"
    assert gc.get_threshold() == default  # the full collection the thaw waits for comes as soon as before
    gc.collect()
    assert keeper.tick(1_000, 2.0) == "freeze" and gc.get_threshold()[0] == 10_000


def test_the_young_threshold_is_bounded_both_ways() -> None:
    assert young_threshold(10, 700) == 700  # never below what the collector had
    assert young_threshold(10**6, 700) == 100_000  # nor holding more than that much cyclic garbage back


def test_a_small_fleet_is_left_to_the_collector() -> None:
    keeper = GcKeeper(from_devices=10)
    assert keeper.tick(9, 0.0) is None
    assert gc.get_freeze_count() == 0


def test_frozen_once_large_again_only_after_growth_and_thawed_when_it_shrinks() -> None:
    keeper = GcKeeper(from_devices=10, refresh_s=1e9)
    assert keeper.tick(10, 0.0) == "freeze"
    assert gc.get_freeze_count() > 0
    assert keeper.tick(10, 1.0) is None and keeper.tick(10, 2.0) is None  # unchanged: nothing to do
    assert keeper.tick(12, 3.0) == "freeze"  # a tenth more devices: their connections are frozen too
    assert keeper.frozen_at_devices == 12 and keeper.freezes == 2
    assert keeper.tick(10, 4.0) == "unfreeze"  # a tenth fewer: what they left is collectable again
    assert gc.get_freeze_count() == 0
    assert keeper.tick(12, 5.0) is None  # thawed until one full collection has run
    gc.collect()
    assert keeper.tick(12, 6.0) == "freeze"


def test_thawed_after_the_refresh_period_even_when_the_fleet_is_steady() -> None:
    keeper = GcKeeper(from_devices=1, refresh_s=60.0)
    assert keeper.tick(5, 0.0) == "freeze"
    assert keeper.tick(5, 30.0) is None
    assert keeper.tick(5, 60.0) == "unfreeze"
    gc.collect()
    assert keeper.tick(5, 61.0) == "freeze" and keeper.frozen_since == 61.0


async def test_the_loop_freezes_a_large_fleet_and_unfreezes_when_cancelled() -> None:
    keeper = GcKeeper(from_devices=1)
    froze = asyncio.Event()
    original = keeper.tick

    def tick(devices: int, now: float) -> str | None:
        done = original(devices, now)
        if done == "freeze":
            froze.set()
        return done

    keeper.tick = tick  # type: ignore[method-assign]
    task = asyncio.create_task(keep_gc_lean(lambda: 1_000, keeper, every=0.001))
    await asyncio.wait_for(froze.wait(), 10)
    assert gc.get_freeze_count() > 0 and gc.get_threshold() != keeper.thresholds
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == keeper.thresholds


def test_the_server_freezes_what_its_start_up_left_at_its_first_tick_and_only_then() -> None:
    ticks: list[int] = []
    tick = freeze_once_started(ticks.append)
    assert gc.get_freeze_count() == 0
    tick(0)
    assert gc.get_freeze_count() > 0 and ticks == [0]  # uvicorn's own tick still runs
    gc.unfreeze()  # as the keeper thaws a shrinking fleet: not frozen again behind its back
    tick(1)
    assert gc.get_freeze_count() == 0 and ticks == [0, 1]
