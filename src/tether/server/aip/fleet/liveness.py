"""`GracePeriods` and `watch_liveness`: deciding when a device is gone, and for how long to wait for it.

A TCP connection can stay open long after the machine behind it has died, and a device that drops
for a moment should not fail its callers. Both are questions of time, not of any one frame: a
device is gone after `heartbeat_timeout` of silence, and its batches wait `grace_period` for it
to come back. The timers live here so the hub's frame handling stays free of clocks; what being
gone *means* (drop the connection, fail the batches) is the hub's, passed in as callbacks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol, TypeVar

from tether.server.settings import ServerSettings

logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name


class Heard(Protocol):
    name: str
    last_seen: float  # time.monotonic() of the last frame from the device


C = TypeVar("C", bound=Heard)


class GracePeriods:
    """One timer per dropped device; `on_expired(device)` runs when a device's grace period ends."""

    def __init__(self, on_expired: Callable[[str], None]) -> None:
        self._on_expired = on_expired
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def __contains__(self, device: str) -> bool:
        return device in self._timers

    def start(self, device: str, period: float) -> None:
        """(Re)start `device`'s grace period; a period of 0 expires it at once."""
        self.stop(device)
        if period > 0:
            self._timers[device] = asyncio.get_running_loop().call_later(period, self._expired, device)
        else:
            self._expired(device)

    def stop(self, device: str) -> None:
        handle = self._timers.pop(device, None)
        if handle is not None:
            handle.cancel()

    def cancel_all(self) -> None:
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()

    def _expired(self, device: str) -> None:
        self._timers.pop(device, None)
        self._on_expired(device)


async def watch_liveness(settings: ServerSettings, conns: Mapping[str, C], *, on_silent: Callable[[C, float], None],
                         check_tokens: Callable[[], Awaitable[None]]) -> None:
    """Forever: `on_silent(conn, seconds)` for each connection silent past `heartbeat_timeout`, and
    `check_tokens()` about once a `heartbeat_interval` while any device is connected — beside the watch, one
    at a time: a check waiting for the database (a locked table) never delays the liveness checks."""
    every = max(0.01, min(settings.heartbeat_interval, settings.heartbeat_timeout / 4))
    checked_tokens = time.monotonic()
    checking: asyncio.Task[None] | None = None

    async def check() -> None:
        try:
            await check_tokens()
        except Exception:
            logger.exception("checking for revoked device tokens failed")

    try:
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            if now - checked_tokens >= settings.heartbeat_interval and conns and (checking is None or checking.done()):
                checked_tokens = now
                checking = asyncio.create_task(check(), name="revoked device tokens")
            _silent_ones(settings, conns, now, on_silent)
    finally:
        if checking is not None:
            checking.cancel()


def _silent_ones(settings: ServerSettings, conns: Mapping[str, C], now: float,
                 on_silent: Callable[[C, float], None]) -> None:
    for conn in list(conns.values()):
        silent = now - conn.last_seen
        if silent > settings.heartbeat_timeout:
            try:
                on_silent(conn, silent)
            except Exception:  # the watch must outlive any one device
                logger.exception("liveness check of device %s failed", conn.name)
