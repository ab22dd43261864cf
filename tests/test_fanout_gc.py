"""The hub's garbage-collector keeper (server/gc_keeper.py): a large fleet's connections are frozen out of
full collections, frozen again as the fleet grows, and unfrozen (for one full collection) when it shrinks
or the refresh period has passed, so that what departed devices left behind is reclaimed. Stepped by
hand (`GcKeeper.tick`), no clock involved; each test leaves the interpreter unfrozen."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from tether.server.gc_keeper import GcKeeper, keep_gc_lean


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


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
    task = asyncio.create_task(keep_gc_lean(lambda: 3, keeper, every=0.001))
    await asyncio.wait_for(froze.wait(), 10)
    assert gc.get_freeze_count() > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gc.get_freeze_count() == 0
