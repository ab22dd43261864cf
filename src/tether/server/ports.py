"""The small interfaces the server's parts depend on instead of on each other.

Each `Protocol` here names only what one consumer calls, so the consumer can be built with the
real object (the hub, the store, a cluster node) or with a stand-in, and no two server modules
need to import each other:

- `RemoteDevices`: what the hub asks of a cluster for devices whose sockets another node holds
  (`tether.server.cluster.node.ClusterNode` is the one implementation), and `RemoteSlot`, where the hub
  finds it;
- `BatchSender`: what a dispatcher needs to run a batch on a device (`DeviceHub`);
- `BatchAudit`: the audit rows a dispatcher and the router write around a batch (`store.audit`);
- `BatchDispatcher` and `DeviceFleet`: what a fan-out needs to reach every device (`DeviceHub`).

The hub stays one node's hub: it knows its own sockets and nothing of Redis. When it is given a
`remote`, a batch for a device that is neither connected here nor in its grace period here is
handed to it, and it runs the batch on the node holding the device and fills the same
`PendingBatch` the caller waits on. The caller's timeouts, cancellation and audit stay where they
were: on the node the caller asked.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from tether.errors import ServerError

if TYPE_CHECKING:
    import asyncio

    from tether.protocol.messages import ClientMessage, Event, ServerMessage
    from tether.protocol.models import Command, Result
    from tether.server.aip.batches.ledger import PendingBatch, TokenRef

Outcome = tuple[str, str | None, str, str | None]  # (response_id, call_id, status, error) of one audit row


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

    def hint(self, device: str) -> str | None:
        """The API base URL (http(s)://host:port) of the node holding `device` when another node holds it, as
        far as this node knows without asking Redis; None when it does not know or holds it itself."""

    async def run_batch(self, batch: PendingBatch, holder: str) -> None:
        """Run `batch` on `holder` and finish it (results, or an error saying why not). Re-routes it when
        the device moves to another node meanwhile, with the same ids, so the device runs it once."""

    async def request(self, holder: str, device: str, message: ServerMessage, timeout: float) -> ClientMessage:
        """`DeviceHub.request` on the node `holder` (a policy request): its answer, or the LookupError or
        TimeoutError that node raised."""

    async def cancel(self, response_id: str, reason: str) -> bool:
        """Cancel a batch another node of the cluster started; False when no node has it."""

    async def answer_question(self, device: str, question: str, action: str, content: dict[str, Any] | None,
                              by: str, answerer: TokenRef | None = None) -> bool:
        """Send an answer to a question an external MCP server of `device` asked, on the node holding it,
        which checks again that `answerer` may give it (`approvals.ApprovalRefused` when not)."""

    def relay(self, topic: str, data: dict[str, Any]) -> None:
        """Tell every other node's `on_relay(topic)` listeners `data` (in order, without waiting): how a
        task's events reach its followers on the nodes that do not run it."""

    def on_relay(self, topic: str, listener: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call `listener(data)` for each `relay(topic, data)` of another node; returns its remover."""

    async def call(self, node: str, kind: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Ask the node `node` with a request its `handle(kind)` answers; raises on no answer in time."""

    def handle(self, kind: str, handler: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
        """Answer other nodes' `call(…, kind, …)` with `handler(body)` (a layer above plugs in its own)."""


class BatchSender(Protocol):
    """Where a dispatcher's batches go: `DeviceHub` (server/aip/hub.py)."""

    @property
    def remote(self) -> RemoteDevices | None:
        """The cluster the sender hands other nodes' devices to, or None on a single server."""

    async def send_batch(self, device: str, message: ServerMessage, *,
                         on_event: Callable[[Event], None] | None = None, here_only: bool = False,
                         asker: TokenRef | None = None) -> PendingBatch:
        """Send the COMMAND `message` to `device` (or queue it, or route it); the batch finishes when its
        results are in, or already `done` with `error` when it cannot be sent. `asker` is the API token
        whose command it is (the caller its MCP servers' questions belong to)."""

    async def cancel(self, response_id: str, reason: str = "cancelled", *, pending: bool = False) -> bool:
        """Finish the batch `response_id` with `reason` and tell its device to stop; False when unknown."""


class BatchAudit(Protocol):
    """The audit rows of a batch, as a dispatcher writes them: the store's audit table (`store.audit`)."""

    def problem(self) -> str | None:
        """None when the log can take a batch's rows, else why not (the batch is then refused)."""

    def sent_grouped(self, rows: Iterable[tuple[Any, ...]]) -> asyncio.Future[str | None]:
        """Insert the `sent` rows with the next group commit; the future gives None, or why they were not."""

    def done_grouped(self, outcomes: Iterable[Outcome]) -> asyncio.Future[None]:
        """Write the outcomes of `sent` rows with the next group commit."""

    def done_queued(self, outcomes: Iterable[Outcome]) -> None:
        """Write the outcomes of `sent` rows without waiting (for a caller being cancelled)."""

    def done(self, outcomes: Iterable[Outcome]) -> None:
        """Write the outcomes of `sent` rows now."""

    def record_soon(self, rows: Iterable[tuple[Any, ...]]) -> None:
        """Write whole rows (a batch refused before it was sent) off the caller's path."""

    def late(self, device: str, outcomes: list[tuple[str, str, str, str | None]],
             then: Callable[[int], None] | None = None) -> int | None:
        """Settle the open outcomes of `device`'s rows with answers that came after their caller stopped
        waiting: (response_id, call_id, status, error); how many rows changed, also given to `then` — or None
        when the write was handed on without waiting, `then(count)` called once it is done."""


class BatchDispatcher(Protocol):
    """Runs one batch on one device: `WebSocketCommandDispatcher` (server/aip/batches/dispatcher.py)."""

    async def execute_commands(self, commands: list[Command], timeout: float | None = None,
                               early_exit: bool = True, *, response_id: str | None = None,
                               own_timer: bool = True) -> list[Result]:
        """One result per command, in order; never raises for what the device does."""


class DeviceFleet(Protocol):
    """What a fan-out (server/aip/batches/fanout.py) needs of the devices beyond their registry: `DeviceHub`."""

    def connected(self, device: str) -> bool:
        """Whether a batch for `device` can go out now."""

    def dispatcher(self, device: str, *, requested_by: str = "unknown",
                   asker: TokenRef | None = None) -> BatchDispatcher:
        """A dispatcher for `device`, auditing its batches as `requested_by`, run for the API token `asker`."""

    def on_fleet_change(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call `listener(device)` when a device registers, leaves or changes; returns its remover."""


class RemoteSlot:
    """Where the hub finds the cluster's `RemoteDevices`: the app factory makes one and builds both the hub
    and the cluster node with it; the node attaches itself while it runs (`start` to `aclose`). Empty on a
    single server, and on a cluster node before it starts and after it stops."""

    def __init__(self) -> None:
        self._remote: RemoteDevices | None = None

    @property
    def remote(self) -> RemoteDevices | None:
        """The attached cluster node, or None."""
        return self._remote

    def attach(self, remote: RemoteDevices) -> None:
        """Route work for other nodes' devices to `remote` from now on."""
        self._remote = remote

    def detach(self) -> None:
        """No cluster from now on: the hub works with the devices connected here only."""
        self._remote = None
