"""Fan-out: one command batch to every device that meets some requirements, results as they arrive.

A `FanOut` selects the known devices that fit a `DeviceRequirements` (connected or not: a matching
device that is offline is part of the answer, reported `offline`, so a summary says what the fleet
is), then runs the batch on each through the hub's own dispatcher — the same audit rows, policy and
cancellation path as `POST /api/v1/devices/{name}/commands` — with at most `max_concurrency` batches
in flight. Each device ends in exactly one outcome:

- `ok`: every command succeeded; `failed`: at least one did not (the device's results say which);
- `offline`: not connected when its turn came, or its link dropped while its batch ran (the batch is
  cancelled, and the device is told so when it comes back within its grace period);
- `timed_out`: the fan-out's overall `timeout` ended first (cancelled on the device, or never sent);
- `cancelled`: the fan-out was cancelled (`cancel()`, or the HTTP caller went away).

Workers pull device names from one iterator, so 10,000 devices cost `max_concurrency` tasks, not
10,000; a device's outcome is queued the moment it is known and `outcomes()` yields them in that order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

from tether.errors import ServerError
from tether.protocol.models import Command, Result, ResultStatus, new_call_id
from tether.protocol.profile import DeviceRequirements
from tether.server.aip.fleet.matching import describe, rejection

if TYPE_CHECKING:
    from tether.server.aip.batches.ledger import TokenRef
    from tether.server.aip.fleet.record import DeviceRecord
    from tether.server.aip.fleet.registry import DeviceRegistry
    from tether.server.ports import DeviceFleet

FanOutStatus = Literal["ok", "failed", "offline", "timed_out", "cancelled"]
STATUSES: tuple[FanOutStatus, ...] = ("ok", "failed", "offline", "timed_out", "cancelled")
DEFAULT_CONCURRENCY = 64
MAX_CONCURRENCY = 1024  # batches in flight at once: beyond it the server's own loop is the bottleneck
MAX_DEVICES = 100_000  # devices in one fan-out


class FanOutError(ServerError, ValueError):
    """A fan-out that cannot start; `status` is the HTTP status that says why (404 none match, 413 too many)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class DeviceOutcome:
    """What became of the batch on one device."""

    device: str
    status: FanOutStatus
    results: list[Result] = field(default_factory=list)
    error: str | None = None
    duration: float = 0.0

    def line(self) -> dict[str, Any]:
        """The JSON line of the stream: results when the batch ran, else the error."""
        out: dict[str, Any] = {"device": self.device, "status": self.status, "duration": round(self.duration, 6)}
        if self.results:
            out["results"] = [r.model_dump(mode="json") for r in self.results]
        if self.error is not None:
            out["error"] = self.error
        return out


def countable(tokened: set[str], scope: Callable[[DeviceRecord], bool] | None) -> Callable[[DeviceRecord], bool]:
    """A fan-out's device test (`within`): in `scope` (a token's; None = every device), and either connected
    or named in `tokened` (the names holding an active device token, `Tokens.active_device_names`). A device
    whose every token is revoked cannot come back, so it is left out rather than reported offline for ever."""
    return lambda record: (scope is None or scope(record)) and (record.connected or record.name in tokened)


def select_devices(registry: DeviceRegistry, requires: DeviceRequirements,
                   within: Callable[[DeviceRecord], bool] | None = None) -> list[str]:
    """The names of every known device meeting `requires` apart from being connected (sorted), and
    admitted by `within` (a token's device scope: the others are not seen); `FanOutError` 404 naming
    the requirements when none does, 413 past `MAX_DEVICES`."""
    chosen: list[str] = []
    known = 0
    for record in registry.list():
        if requires.name is not None and record.name != requires.name:
            continue
        if within is not None and not within(record):
            continue
        known += 1
        # an offline device is judged on what it is, as if connected: it is reported offline, not left out
        probe: Any = record if record.connected else SimpleNamespace(name=record.name, connected=True,
                                                                      profile=record.profile)
        if rejection(probe, requires) is None:
            chosen.append(record.name)
    if not chosen:
        why = "no device has registered" if not known else f"none of the {known} known device(s) fits"
        raise FanOutError(404, f"no device fits {describe(requires)}: {why}")
    if len(chosen) > MAX_DEVICES:
        raise FanOutError(413, f"{len(chosen)} devices fit {describe(requires)}; one fan-out reaches at most "
                               f"{MAX_DEVICES}: narrow the requirements (tags, platform, tools)")
    return chosen


class FanOut:
    """One fan-out: build it (devices are selected at once), then iterate `outcomes()` exactly once.

    `fleet` (the hub) runs the batches and says who is connected; `registry` is where the devices that
    meet `requires` are chosen from. `FanOutError` when it cannot start (no command, none fit, too many)."""

    def __init__(self, fleet: DeviceFleet, registry: DeviceRegistry, requires: DeviceRequirements,
                 commands: list[Command], *,
                 max_concurrency: int = DEFAULT_CONCURRENCY, timeout: float = 60.0, early_exit: bool = True,
                 requested_by: str = "unknown", fanout_id: str | None = None,
                 within: Callable[[DeviceRecord], bool] | None = None, asker: TokenRef | None = None) -> None:
        if not commands:
            raise FanOutError(422, "a fan-out needs at least one command")
        self.fleet = fleet
        self.requires = requires
        self.commands = commands
        self.max_concurrency = max(1, min(max_concurrency, MAX_CONCURRENCY))
        self.timeout = timeout
        self.early_exit = early_exit
        self.requested_by = requested_by
        self.asker = asker  # the API token it runs for: its MCP servers' questions are its (PendingBatch.asker)
        self.id = fanout_id or new_call_id()
        self.devices = select_devices(registry, requires, within)
        self.counts: dict[str, int] = dict.fromkeys(STATUSES, 0)
        self.in_flight = 0
        self.max_in_flight = 0
        self._queue: asyncio.Queue[DeviceOutcome] = asyncio.Queue()
        self._running: dict[str, asyncio.Task[None]] = {}  # device → the worker running its batch
        self._cancels: dict[str, int] = {}  # device → cancellations this fan-out sent its worker for it
        self._left: dict[str, str] = {}  # device → why it went offline while its batch ran
        self._ended: tuple[FanOutStatus, str] | None = None  # set once: cancelled / timed out
        self._started = 0.0
        self._deadline = 0.0

    # -- control ------------------------------------------------------------------------------------

    def cancel(self, reason: str = "cancelled: the fan-out was cancelled") -> None:
        """End the fan-out: batches in flight are cancelled on their devices, the rest never sent."""
        self._end("cancelled", reason)

    def _end(self, status: FanOutStatus, reason: str) -> None:
        if self._ended is not None:
            return
        self._ended = (status, reason)
        for device in list(self._running):
            self._stop(device, reason)

    def _fleet_changed(self, device: str) -> None:
        if device in self._running and not self.fleet.connected(device):
            why = f"device {device} went offline while its batch ran; the batch was cancelled"
            self._left[device] = why
            self._stop(device, why)

    def _stop(self, device: str, reason: str) -> None:
        """Cancel the batch running on `device`: its worker's await of the dispatcher, which cancels the
        batch on the device and audits why; the worker counts the cancellation as this fan-out's own."""
        self._cancels[device] = self._cancels.get(device, 0) + 1
        self._running[device].cancel(reason)

    # -- running ------------------------------------------------------------------------------------

    async def outcomes(self) -> AsyncIterator[DeviceOutcome]:
        """Each device's outcome as soon as it is known; closing the iterator early cancels the rest."""
        self._started = time.monotonic()
        self._deadline = self._started + self.timeout
        names = iter(self.devices)
        remove = self.fleet.on_fleet_change(self._fleet_changed)
        workers = [asyncio.ensure_future(self._worker(names)) for _ in range(min(self.max_concurrency,
                                                                                len(self.devices)))]
        clock = asyncio.get_running_loop().call_at(asyncio.get_running_loop().time() + self.timeout, self._end,
                                                   "timed_out", f"timed out: the fan-out's timeout of "
                                                                f"{self.timeout:g}s ended first")
        try:
            for _ in range(len(self.devices)):
                outcome = await self._queue.get()
                self.counts[outcome.status] += 1
                yield outcome
        finally:
            clock.cancel()
            remove()
            if sum(self.counts.values()) < len(self.devices):  # the caller stopped listening: stop the devices too
                self.cancel("cancelled: the caller of the fan-out went away")
                for worker in workers:
                    worker.cancel()

    def summary(self) -> dict[str, Any]:
        return {**self.counts, "total": len(self.devices), "duration": round(time.monotonic() - self._started, 6)}

    async def _worker(self, names: Iterator[str]) -> None:
        for name in names:
            try:
                outcome = await self._one(name)
            except Exception as exc:  # a bug must cost one device's line, never hang the whole fan-out
                outcome = DeviceOutcome(name, "failed", error=f"internal error: {type(exc).__name__}: {exc}")
            self._queue.put_nowait(outcome)

    async def _one(self, name: str) -> DeviceOutcome:
        started = time.monotonic()
        if self._ended is not None:
            status, reason = self._ended
            never = "timed out before its turn came" if status == "timed_out" else reason
            return DeviceOutcome(name, status, error=f"not sent: {never}")
        if not self.fleet.connected(name):
            return DeviceOutcome(name, "offline", error=f"device {name} is offline; not sent")
        dispatcher = self.fleet.dispatcher(name, requested_by=self.requested_by, asker=self.asker)
        commands = [c.model_copy() for c in self.commands]  # the dispatcher stamps call_ids (only those)
        remaining = max(self._deadline - time.monotonic(), 0.001)
        worker = asyncio.current_task()
        assert worker is not None
        # the batch runs in this worker, not in a task of its own (a task and an asyncio.wait per device
        # were ~6% of the server's CPU in a 4,000-device fan-out): `_stop` cancels this await
        self._running[name] = worker
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            results = await dispatcher.execute_commands(commands, timeout=remaining + 1.0, early_exit=self.early_exit,
                                                        own_timer=False)  # our clock (`_end`) ends it
        except asyncio.CancelledError:
            ours = self._cancels.get(name, 0)
            for _ in range(ours):
                worker.uncancel()
            if not ours or worker.cancelling():  # cancelled from outside too: the worker ends
                raise
            duration = time.monotonic() - started
            if name in self._left:
                return DeviceOutcome(name, "offline", error=self._left[name], duration=duration)
            status, reason = self._ended or ("cancelled", "cancelled")
            return DeviceOutcome(name, status, error=reason, duration=duration)
        finally:
            self.in_flight -= 1
            self._running.pop(name, None)
            self._cancels.pop(name, None)
        duration = time.monotonic() - started
        failed = [r for r in results if r.status is not ResultStatus.SUCCESS]
        if not failed:
            return DeviceOutcome(name, "ok", results, duration=duration)
        if name in self._left:
            return DeviceOutcome(name, "offline", results, self._left[name], duration)
        return DeviceOutcome(name, "failed", results, failed[0].error or failed[0].status.value, duration)


async def run_fan_out(fleet: DeviceFleet, registry: DeviceRegistry, requires: DeviceRequirements,
                      commands: list[Command], *,
                      on_outcome: Callable[[DeviceOutcome], None] | None = None,
                      **options: Any) -> dict[str, Any]:
    """Run a fan-out to the end: `{"devices": [lines…], "summary": {…}}` (for callers that need no stream,
    such as a task step); `on_outcome` is told each device's outcome as it arrives."""
    fan = FanOut(fleet, registry, requires, commands, **options)
    lines = []
    async for outcome in fan.outcomes():
        if on_outcome is not None:
            on_outcome(outcome)
        lines.append(outcome.line())
    return {"devices": lines, "summary": fan.summary()}
