"""What both sides of a crossing batch share: the routes, the results' codec, and the outcomes of batches
answered for other nodes, kept (and recorded here) while their node could die unheard."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from tether.protocol.messages import ServerMessage
from tether.protocol.models import Result

if TYPE_CHECKING:
    from tether.server.aip.batches.ledger import PendingBatch
    from tether.server.aip.fleet.registry import DeviceRegistry
    from tether.server.aip.hub import DeviceHub
    from tether.server.cluster.bus import Bus
    from tether.server.settings import ServerSettings
    from tether.server.store import Store

log = logging.getLogger("tether.cluster")

NOT_HERE = "not held here"  # the holding node's refusal when the device left it: the asker looks again
ANSWER_TIMEOUT_S = 10.0  # a cancel or an answer crossing to another node
ANSWERED_MEMORY = 10_000  # outcomes of batches answered for other nodes, kept while a node could die unheard
MAX_REROUTES = 16  # a device bouncing between nodes faster than batches reach it: give up clearly
RESULTS = TypeAdapter(list[Result])


@dataclass(eq=False)
class Route:
    """One batch on its way to `holder`, as the bus request `rid`; `moved` once the device is seen on
    another node (the request is interrupted then)."""

    device: str
    holder: str
    rid: str = field(default_factory=lambda: secrets.token_hex(8))
    moved: bool = False
    # interrupted because its node was called gone (its lease ran out, the backplane restarted empty), not
    # because the device was seen elsewhere: that node may come back still holding the device, and the batch
    # may go to it again (same request id: the device answers a call it already ran from its record)
    gone: bool = False


class RouterCore:
    """The `Router`'s state and its record of outcomes (see `Router` for the arguments): the sides that ask
    (asking.py) and hold (holding.py) build on it."""

    def __init__(self, hub: DeviceHub, registry: DeviceRegistry, store: Store, settings: ServerSettings, bus: Bus,
                 node: str, holder: Callable[..., Awaitable[str | None]]) -> None:
        self.hub = hub
        self.registry = registry
        self.store = store
        self.settings = settings
        self.bus = bus
        self.node = node
        self._holder = holder  # ClusterNode.holder(device, fresh=True): the directory's answer, dead nodes left out
        self._routes: dict[str, set[Route]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # whether a node is alive (ClusterNode sets it): an answer for a dead node is recorded here instead
        self.alive: Callable[[str], bool] | None = None
        # the outcomes of batches answered for other nodes lately: (when, node, device, batch, outcomes), so
        # that if that node dies before writing them (its answer in a dead inbox) this node records them
        self._answered: deque[tuple[float, str, str, str, list[tuple[str, str, str | None]]]] = \
            deque(maxlen=ANSWERED_MEMORY)


    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _answer_window(self) -> float:
        settings = self.settings
        return 2 * settings.lease_s + settings.grace_period

    def _answered_for(self, origin: str, device: str, response_id: str, batch: PendingBatch) -> None:
        """Remember (or, for a node already gone, record) the outcomes of a batch run here for `origin`."""
        outcomes = [(cid, r.status.value, r.error) for cid, r in batch.results.items()]
        if not outcomes or not origin:
            return
        if self.alive is not None and not self.alive(origin):
            self._settle(device, response_id, outcomes, f"node {origin} is gone")
            return
        now = asyncio.get_running_loop().time()
        while self._answered and self._answered[0][0] < now - self._answer_window():
            self._answered.popleft()
        self._answered.append((now, origin, device, response_id, outcomes))

    def _settle(self, device: str, response_id: str, outcomes: list[tuple[str, str, str | None]], why: str) -> None:
        def then(settled: int) -> None:
            if settled:
                log.warning("batch %s: %d outcome(s) recorded by node %s (%s)", response_id, settled, self.node, why)

        try:  # written off the event loop (PostgreSQL); `then` tells how many rows it settled
            self.store.audit.late(device, [(response_id, cid, status, error) for cid, status, error in outcomes], then)
        except Exception:
            log.exception("could not record the outcomes of batch %s (%s)", response_id, why)

    def record_unclaimed(self, body: dict[str, Any]) -> None:
        """An answer to a batch this node gave up waiting for (the backplane was down; its caller was told
        "outcome pending") arrived after all: its outcomes are recorded (`DeviceHub.record_late`)."""
        device, response_id = body.get("device"), body.get("response_id")
        if not isinstance(device, str) or not isinstance(response_id, str) or "results" not in body:
            return
        try:
            results = RESULTS.validate_json(body.get("results") or "[]")
        except ValueError:
            return
        def then(settled: int) -> None:
            if settled:
                log.warning("batch %s: %d outcome(s) that came after node %s stopped waiting recorded", response_id,
                            settled, self.node)

        self.hub.record_late(device, response_id, results, then)

    def record_lost_answer(self, body: dict[str, Any], reply: dict[str, Any]) -> None:
        """The answer to a batch request never reached the asking node (the backplane is down), whose caller
        was told "outcome pending": the outcomes this node holds go into the audit (shared by the nodes)
        themselves, settling the rows that node left `sent` or `pending` (`AuditLog.late`)."""
        device = str(body.get("device") or "")
        try:
            message = ServerMessage.model_validate_json(body.get("message") or "{}")
            results = RESULTS.validate_json(reply.get("results") or "[]")
        except ValueError:
            return
        def then(settled: int) -> None:
            log.warning("batch %s: %d outcome(s) the asking node never heard recorded by node %s",
                        message.response_id, settled, self.node)

        self.store.audit.late(device, [(message.response_id, r.call_id, r.status.value, r.error)
                                       for r in results if r.call_id], then)
