"""`keep_gc_lean`: keep 10,000 idle device connections out of the cyclic garbage collector's full scans.

Each registered device holds a few hundred long-lived objects (its socket's protocol, tasks, futures,
its record and profile). CPython's full collection walks every one of them whenever the survivors since
the last one reach a quarter of the heap: with 10,000 devices connected, a fan-out's short-lived
batches trigger full collections back to back, and measured on the 2-core machine `gc_collect_main`
took 47-52 % of the server's CPU during a fan-out to 10,000 devices (py-spy --native), ahead of every
socket write. `gc.freeze()` moves every object alive now into the permanent generation, which no
collection walks; the fleet's connections are exactly such objects.

The price of freezing is that garbage cycles frozen with the rest are reclaimed only after an
`unfreeze`: so the heap is frozen again only when the fleet grew by a tenth since the last freeze, and
unfrozen (for one full collection, then frozen again) when it shrank by a tenth or every
`refresh_s` — what departed devices left behind is collected then. Small fleets (below `from_devices`)
are left to the collector's defaults.

While frozen, the young generation's threshold grows with the fleet (`YOUNG_PER_DEVICE` allocations per
device, at most `YOUNG_MAX`): the default of 700 had the collector run every few batches of a fan-out to
10,000 devices, each time walking the batches in flight and promoting them to older generations to be
walked again. Measured with the server's gc callbacks: 2.6 s of collections in 4 fan-outs (40% of the
server's CPU); at 100,000 none ran during a fan-out, and a fan-out took 1.52 s instead of 1.88 s. Most
objects die by reference counting; what the larger threshold holds back is cyclic garbage, at most that
many objects (a few MB) more. Thawing restores the default, so the full collection it waits for comes soon.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("tether.server.hub")

FREEZE_FROM_DEVICES = 500  # below this the collector's defaults cost little
CHECK_EVERY_S = 5.0
REFRESH_S = 600.0
GROWTH = 1.1  # freeze again when the fleet is this much larger than at the last freeze
SHRINK = 0.9  # ... unfreeze when it is this much smaller
YOUNG_PER_DEVICE = 10  # the young generation's threshold while frozen, per device (CPython's default: 700)
YOUNG_MAX = 100_000


def young_threshold(devices: int, default: int) -> int:
    """The young generation's threshold for a frozen fleet of `devices`: never below `default`."""
    return max(default, min(devices * YOUNG_PER_DEVICE, YOUNG_MAX))


@dataclass
class GcKeeper:
    """The freeze decisions, apart from the clock so that tests can step them: call `tick(devices, now)`."""

    from_devices: int = FREEZE_FROM_DEVICES
    refresh_s: float = REFRESH_S
    frozen_at_devices: int = 0  # 0: not frozen by us
    frozen_since: float = 0.0
    thawed_collections: int | None = None  # full collections counted when we unfroze; None: not thawing
    freezes: int = 0
    thresholds: tuple[int, int, int] = field(default_factory=gc.get_threshold)  # as found: restored on thaw

    def tick(self, devices: int, now: float) -> str | None:
        """Act on the fleet's size now; returns what was done ('freeze', 'unfreeze') or None."""
        full = gc.get_stats()[2]["collections"]
        if self.thawed_collections is not None:  # unfrozen: wait for one full collection to reclaim
            if full == self.thawed_collections:
                return None
            self.thawed_collections = None
        if self.frozen_at_devices:
            if devices < self.frozen_at_devices * SHRINK or now - self.frozen_since >= self.refresh_s:
                gc.unfreeze()
                gc.set_threshold(*self.thresholds)
                self.frozen_at_devices, self.thawed_collections = 0, full
                return "unfreeze"
            if devices < self.frozen_at_devices * GROWTH:
                return None
        elif devices < self.from_devices:
            return None
        gc.freeze()
        gc.set_threshold(young_threshold(devices, self.thresholds[0]), *self.thresholds[1:])
        if not self.frozen_at_devices:
            self.frozen_since = now
        self.frozen_at_devices = max(devices, 1)
        self.freezes += 1
        return "freeze"


async def keep_gc_lean(devices: Callable[[], int], keeper: GcKeeper | None = None,
                       every: float = CHECK_EVERY_S) -> None:
    """Run `keeper.tick` every `every` seconds with the number of `devices()` until cancelled; unfreezes
    on the way out so that a stopped server's objects are collected again."""
    keeper = keeper or GcKeeper()
    loop = asyncio.get_running_loop()
    try:
        while True:
            await asyncio.sleep(every)
            done = keeper.tick(devices(), loop.time())
            if done is not None:
                logger.debug("gc %s with %d devices (permanent generation: %d objects)", done, devices(),
                             gc.get_freeze_count())
    finally:
        if keeper.frozen_at_devices:
            gc.unfreeze()
            gc.set_threshold(*keeper.thresholds)
