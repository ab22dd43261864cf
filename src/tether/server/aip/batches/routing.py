"""`DeviceHub`'s batch routing: the hub's face of `BatchRouter` (`tether.server.aip.batches.router`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tether.protocol.messages import (
    Event,
    ServerMessage,
)
from tether.server.aip.batches.ledger import PendingBatch, TokenRef
from tether.server.aip.hub_state import HubState
from tether.server.ports import RemoteDevices

logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name


class HubBatches(HubState):
    """Batches sent, routed between nodes, finished and cancelled, through the hub's `BatchRouter`."""

    @property
    def remote(self) -> RemoteDevices | None:
        """The other nodes of a cluster (a `ports.RemoteDevices`) while this server's cluster node runs:
        batches for a device held by another node go there; None on a single server."""
        return self._router.remote

    async def send_batch(self, device: str, message: ServerMessage, *,
                         on_event: Callable[[Event], None] | None = None, here_only: bool = False,
                         asker: TokenRef | None = None) -> PendingBatch:
        """`BatchRouter.send_batch`: send a COMMAND batch, queue it or hand it to the node holding `device`."""
        return await self._router.send_batch(device, message, on_event=on_event, here_only=here_only, asker=asker)

    def route(self, batch: PendingBatch, holder: str) -> None:
        """`BatchRouter.route`: let the node `holder` run `batch`."""
        self._router.route(batch, holder)

    async def adopt(self, batch: PendingBatch) -> None:
        """`BatchRouter.adopt`: a batch another node ran came back with its device, connected here."""
        await self._router.adopt(batch)

    def moved(self, device: str, holder: str) -> None:
        """`BatchRouter.moved`: another node took `device`'s socket."""
        self._router.moved(device, holder)

    def finish_remote(self, batch: PendingBatch, results: list[Any], error: str | None, *,
                      pending: bool = False) -> None:
        """`BatchRouter.finish_remote`: the holding node's answer for `batch`."""
        self._router.finish_remote(batch, results, error, pending=pending)

    def record_late(self, device: str, response_id: str, results: list[Any],
                    then: Callable[[int], None] | None = None) -> int | None:
        """`BatchRouter.record_late`: record results that came after their caller stopped waiting."""
        return self._router.record_late(device, response_id, results, then)

    def batch_device(self, response_id: str) -> str | None:
        """`BatchRouter.batch_device`: the device of a batch in flight here, or None."""
        return self._router.batch_device(response_id)

    async def cancel(self, response_id: str, reason: str = "cancelled", *, pending: bool = False) -> bool:
        """`BatchRouter.cancel`: finish the batch with `reason` and tell its device to stop."""
        return await self._router.cancel(response_id, reason, pending=pending)
