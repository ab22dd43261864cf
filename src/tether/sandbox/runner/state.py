"""What the parts of the device's `Sandbox` share: its constants and its state's declarations."""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tether.sandbox.confine.guard import LivePlan
from tether.sandbox.confine.spec import SandboxSpec
from tether.sandbox.detect import SandboxInfo
from tether.sandbox.egress.proxy import AskFn, EgressProxy, EgressRecord
from tether.sandbox.kept import Kept
from tether.sandbox.layers.held import HeldLayers
from tether.sandbox.layers.session import SessionTotals
from tether.sandbox.private_tmp import PrivateTmp

logger = logging.getLogger("tether.sandbox.runner")
egress_log = logging.getLogger("tether.sandbox.egress")

START_TIMEOUT_S = 15.0
FREE_LAYERS = 8
SWEEP_BATCH = 16  # old overlay work directories removed together, off the event loop (see _sweep)
MAX_REPLY = 1 << 16
NO_LIVE = LivePlan()  # no live root: nothing to freeze or bind read-only (live_plan would scan for nothing)
PROXY_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
NO_PROXY_ENV = ("NO_PROXY", "no_proxy")
# threads that scan, apply and remove layers: a command that made 100,000 files takes one of them, never
# the event loop every other session is served from; more at once wait their turn
CAPTURE_WORKERS = 2
# paths remembered from this device's recent applies, so a conflict between two of its sessions is told
# exactly (not only by ctime, whose coarse clock can lag a change by a tick); older ones are forgotten
APPLIED_LOG_PATHS = 200_000
MAX_HELD_SINCE = 256  # start times kept for layers not yet released, before those of vanished layers are pruned
T = TypeVar("T")


class SandboxParts:
    """The state the parts of a `Sandbox` share (set by `Sandbox.__init__`), and what each part calls of
    another: the warden's client (`warden`), the layers' bookkeeping (`layers`), the requests' contents
    (`requests`) and the egress side (`egress`)."""

    info: SandboxInfo
    spec: SandboxSpec
    _proc: asyncio.subprocess.Process | None
    _sock: socket.socket | None
    _starting: asyncio.Lock | None
    _waiters: dict[int, tuple[asyncio.Future[int], asyncio.Future[int]]]
    _ids: itertools.count[int]
    _layer_ids: itertools.count[int]
    _closed: bool
    held: HeldLayers
    kept: Kept | None
    sessions: SessionTotals
    _keeping: asyncio.Future[None] | None
    _keep_again: bool
    _free: list[Path]
    _primed: tuple[Path, int] | None
    _reserved: dict[Path, int]
    _layer_of: dict[int, Path]
    _gone: list[Path]
    _warden_host_pid: int | None
    _notes: dict[int, list[str]]
    _cpu: dict[int, float]
    _removing: set[asyncio.Future[None]]
    _audit: Callable[[EgressRecord, str], None] | None
    _ask: AskFn | None
    _askers: dict[int, AskFn]
    egress: EgressProxy | None
    _proxy_port: int | None
    _proxy_task: asyncio.Task[None] | None
    _connections: dict[int, list[EgressRecord]]
    _warden_pids: dict[int, int]
    filters: bool
    prime: bool
    _limits: dict[str, Any]
    _pool: ThreadPoolExecutor
    _since: dict[Path, tuple[int, int]]
    _applied: deque[tuple[int, frozenset[str], frozenset[str]]]
    _applied_paths: int
    _apply_seq: int
    _forgotten: int
    private_tmp: PrivateTmp | None

    if TYPE_CHECKING:  # defined by one part, called by another
        def _send(self, message: dict[str, Any], fds: list[int] = ...) -> None: ...
        def _drop_warden(self, why: str) -> None: ...
        def _sweep(self, request_id: int) -> None: ...
        def _own(self, path: Path) -> None: ...
        def _mounts(self, layer: Path | None, display: tuple[str, ...] = ...) -> dict[str, Any]: ...
        def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]: ...
        async def offload(self, fn: Callable[..., T], *args: Any) -> T: ...
