"""What every part of `DeviceHub` (`tether.server.aip.hub`) shares: its tables, its collaborators and the
methods one part calls on another, declared once for the type checker (the hub sets them all)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.protocol.messages import ClientMessage, Event
    from tether.protocol.server_session import SessionEvent
    from tether.server.aip.batches.ledger import BatchBook, PendingBatch
    from tether.server.aip.batches.router import BatchRouter
    from tether.server.aip.fleet.liveness import GracePeriods
    from tether.server.aip.fleet.record import DeviceRecord
    from tether.server.aip.fleet.registry import DeviceRegistry
    from tether.server.aip.questions.asked import OpenQuestions, Sampler, SamplingGate
    from tether.server.aip.sockets.link import DeviceLink
    from tether.server.aip.sockets.socket import AIPSocket, Refusal
    from tether.server.notify.notifier import Notifier
    from tether.server.ports import RemoteDevices
    from tether.server.settings import ServerSettings
    from tether.server.store import Store
    from tether.server.store.tokens import TokenInfo


class HubState:
    """The attributes `DeviceHub.__init__` sets, and the hub's methods its parts call on each other."""

    store: Store
    notifier: Notifier | None
    settings: ServerSettings
    registry: DeviceRegistry
    sampler: Sampler | None
    _conns: dict[str, DeviceLink]
    _grace: GracePeriods
    _arriving: dict[str, int]
    _expired_meanwhile: set[str]
    _given_up: dict[str, str]
    _tasks: set[asyncio.Task[Any]]
    _router: BatchRouter
    _batches: BatchBook
    _replies: dict[str, tuple[str, asyncio.Future[ClientMessage]]]
    _questions: OpenQuestions
    _sampling: SamplingGate
    _closed: bool

    if TYPE_CHECKING:
        @property
        def remote(self) -> RemoteDevices | None: ...

        def pending(self, response_id: str) -> PendingBatch | None: ...

        async def authenticate(self, authorization: str | None) -> TokenInfo | Refusal: ...

        def deliver_event(self, batch: PendingBatch, event: Event) -> None: ...

        def _fleet_changed(self, device: str) -> None: ...

        def _drop(self, conn: DeviceLink, why: str, *, grace: bool = True) -> None: ...

        def _close_conn(self, conn: DeviceLink, code: int, reason: str) -> None: ...

        def _remember(self, device: str, record: DeviceRecord | None, last_seen: float) -> None: ...

        def _grace_expired(self, device: str) -> None: ...

        def _restarted(self, device: str) -> None: ...

        async def _receive_loop(self, conn: DeviceLink) -> None: ...

        async def _handle(self, conn: DeviceLink, event: SessionEvent) -> None: ...

        async def _register(self, socket: AIPSocket, authorization: str | None, peer: str | None,
                            challenge: str | None = None) -> DeviceLink | None: ...
