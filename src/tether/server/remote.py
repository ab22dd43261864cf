"""`RemoteDevices`: what the hub asks of a cluster for devices whose sockets another node holds.

The hub stays one node's hub: it knows its own sockets and nothing of Redis. When it is given a
`remote` (a `tether.server.cluster.node.ClusterNode`), a batch for a device that is neither
connected here nor in its grace period here is handed to it, and it runs the batch on the node
holding the device and fills the same `PendingBatch` the caller waits on. The caller's timeouts,
cancellation and audit stay where they were: on the node the caller asked.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from tether.errors import ServerError

if TYPE_CHECKING:
    from tether.protocol.messages import ClientMessage, ServerMessage
    from tether.server.batches import PendingBatch


class BackplaneUnavailable(ServerError):
    """The cluster's backplane (Redis) cannot be reached: work for devices on other nodes is refused."""


class RemoteDevices(Protocol):
    node: str

    def problem(self) -> str | None:
        """Why work for other nodes' devices is refused now (the backplane is unreachable), or None."""

    async def claimed(self, device: str) -> None:
        """Return once the cluster knows `device` (registering here) is held by this node (bounded)."""

    async def holder(self, device: str) -> str | None:
        """The node holding `device`'s socket now, or None; raises `BackplaneUnavailable`."""

    async def run_batch(self, batch: PendingBatch, holder: str) -> None:
        """Run `batch` on `holder` and finish it (results, or an error saying why not). Re-routes it when
        the device moves to another node meanwhile, with the same ids, so the device runs it once."""

    async def request(self, holder: str, device: str, message: ServerMessage, timeout: float) -> ClientMessage:
        """`DeviceHub.request` on the node `holder` (a policy request): its answer, or the LookupError or
        TimeoutError that node raised."""

    async def cancel(self, response_id: str, reason: str) -> bool:
        """Cancel a batch another node of the cluster started; False when no node has it."""

    async def answer_question(self, device: str, question: str, action: str, content: dict[str, Any] | None,
                              by: str) -> bool:
        """Send an answer to a question an external MCP server of `device` asked, on the node holding it."""

    def relay(self, topic: str, data: dict[str, Any]) -> None:
        """Tell every other node's `on_relay(topic)` listeners `data` (in order, without waiting): how a
        task's events reach its followers on the nodes that do not run it."""

    def on_relay(self, topic: str, listener: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call `listener(data)` for each `relay(topic, data)` of another node; returns its remover."""

    async def call(self, node: str, kind: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Ask the node `node` with a request its `handle(kind)` answers; raises on no answer in time."""

    def handle(self, kind: str, handler: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
        """Answer other nodes' `call(…, kind, …)` with `handler(body)` (a layer above plugs in its own)."""
