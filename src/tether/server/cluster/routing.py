"""Batches across nodes: the asking node's side (`Router.run_batch`) and the holding node's (`serve_*`).

A batch for a device whose socket another node holds is sent to that node over the bus with its
ids unchanged; that node runs it through its own hub (`here_only`: it never forwards again, so a
stale directory cannot make two nodes bounce a batch between them) and streams the device's events
back as partial replies, then the results. What stays on the asking node: the caller, its timeout,
its cancellation and the audit rows — one row per command, written where the caller asked.

When the device moves meanwhile (its node died, or the device reconnected elsewhere), the batch is
sent again, with the same `response_id` and `call_id`s, to the node holding it now: the device runs
a call once and answers a repeat from its record of finished calls, exactly as it does when it
reconnects to a single server (at-least-once delivery, exactly-once execution). A device that is
held by no node for longer than the grace period fails the batch, as on a single server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from tether.protocol.messages import ClientMessage, Event, ServerMessage, ServerMessageType
from tether.protocol.models import Result
from tether.server.aip.batches.ledger import TokenRef
from tether.server.approvals import ApprovalRefused
from tether.server.cluster.bus import Bus, BusError, BusInterrupted

if TYPE_CHECKING:
    from tether.server.aip.batches.ledger import PendingBatch
    from tether.server.aip.fleet.registry import DeviceRegistry
    from tether.server.aip.hub import DeviceHub
    from tether.server.settings import ServerSettings
    from tether.server.store import Store

log = logging.getLogger("tether.cluster")

NOT_HERE = "not held here"  # the holding node's refusal when the device left it: the asker looks again
ANSWER_TIMEOUT_S = 10.0  # a cancel or an answer crossing to another node
ANSWERED_MEMORY = 10_000  # outcomes of batches answered for other nodes, kept while a node could die unheard
MAX_REROUTES = 16  # a device bouncing between nodes faster than batches reach it: give up clearly
_RESULTS = TypeAdapter(list[Result])


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


class Router:
    """Runs batches on other nodes for this node's hub, and other nodes' batches on this node's hub.

    `registry` is the hub's (who is connected here), `store` records outcomes whose asker is gone, and
    `settings` gives the timeouts; `holder(device, fresh=True)` asks the directory who holds a device."""

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

    # -- the asking node ---------------------------------------------------------------------------

    def device_seen(self, device: str, holder: str | None) -> None:
        """The directory says `device` is held by `holder` now: batches sent elsewhere follow it.

        Held by no node (None) moves nothing: the node a batch went to still answers for it — its device
        back within its grace period, "not held here", or its own grace's failure — and a dead node is
        `node_gone`'s. A view that lost the device for a while (Redis restarted empty, a slow re-announce)
        must not fail a command its device is still running there."""
        if holder is None:
            return
        for route in self._routes.get(device, ()):
            if route.holder != holder:
                self._moved(route)

    def node_gone(self, node: str) -> None:
        for routes in self._routes.values():
            for route in routes:
                if route.holder == node:
                    route.gone = True
                    self._moved(route)
        # what this node answered the dead one lately may never have reached its audit: settled here (only
        # rows still open change, so an outcome that node did write stays as it is)
        horizon = asyncio.get_running_loop().time() - self._answer_window()
        kept: deque[tuple[float, str, str, str, list[tuple[str, str, str | None]]]] = deque(maxlen=ANSWERED_MEMORY)
        for entry in self._answered:
            when, origin, device, response_id, outcomes = entry
            if origin == node and when >= horizon:
                self._settle(device, response_id, outcomes, f"node {node} is gone")
            elif origin != node:
                kept.append(entry)
        self._answered = kept

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

    def _moved(self, route: Route) -> None:
        route.moved = True
        self.bus.interrupt(route.rid)

    async def run_batch(self, batch: PendingBatch, holder: str) -> None:
        hub = self.hub
        grace = self.settings.grace_period
        for _ in range(MAX_REROUTES):
            route = Route(batch.device, holder)
            self._routes.setdefault(batch.device, set()).add(route)
            try:
                moved = await self._run_on(batch, route)
            finally:
                routes = self._routes.get(batch.device)
                if routes is not None:
                    routes.discard(route)
                    if not routes:
                        del self._routes[batch.device]
            if not moved:
                return
            log.info("batch %s follows device %s away from node %s", batch.response_id, batch.device, holder)
            try:
                found = await self._wait_holder(batch.device, exclude=None if route.gone else holder,
                                                timeout=grace)
            except Exception as exc:  # nothing says the device moved, or that its command stopped
                hub.finish_remote(batch, [], f"the cluster backplane is unreachable ({exc}), so node {self.node} "
                                             f"cannot follow batch {batch.response_id} to device {batch.device} "
                                             f"(last held by node {holder})", pending=True)
                return
            if found is None:
                hub.finish_remote(batch, [], f"device {batch.device} left node {holder} and did not come back "
                                             f"within the {grace:g}s grace period")
                return
            if found == self.node:
                await hub.adopt(batch)
                return
            holder = found
        hub.finish_remote(batch, [], f"device {batch.device} moved between nodes {MAX_REROUTES} times while "
                                     "its batch was on the way; not sent again")

    async def _wait_holder(self, device: str, exclude: str | None, timeout: float) -> str | None:
        """The node holding `device` other than `exclude` (which it left; None: any node), waiting at most
        `timeout` seconds for one; this node when the device came here."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self.hub.local(device):
                return self.node
            found = await self._holder(device, fresh=True)
            if found is not None and found != exclude:
                return found
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            # woken by the registry (this node, or the cluster's view of another), bounded by the grace period
            await self.registry.wait_until(lambda: self._arrived(device, exclude), min(remaining, 1.0))

    def _arrived(self, device: str, exclude: str | None) -> bool:
        record = self.registry.get(device)
        return self.hub.local(device) or (record is not None and record.node not in (None, exclude))

    async def _run_on(self, batch: PendingBatch, route: Route) -> bool:
        """Run `batch` on `route.holder`; True when the device moved away first (send it again)."""
        hub = self.hub
        message = batch.message
        limit = (message.timeout or self.settings.default_command_timeout) + self.settings.lease_s + 10
        # the message as its JSON text: pydantic writes and reads it faster than a dict the bus encodes again
        body = {"device": batch.device, "from": self.node, "message": message.model_dump_json(exclude_none=True),
                "asker": batch.asker.to_dict() if batch.asker is not None else None}  # whose questions they are

        def on_part(part: dict[str, Any]) -> None:  # a device event, as it streams (from the bus's reader)
            try:
                event = Event.model_validate(part.get("event"))
            except ValueError:
                return
            hub.deliver_event(batch, event)

        settled = False

        def on_done(final: dict[str, Any]) -> None:  # the answer, finished here the moment it comes: the caller's
            nonlocal settled  # task wakes next, not after this one's
            if batch.done.is_set():
                return  # ended here meanwhile (cancelled, timed out): as before, its task handles the rest
            if NOT_HERE in str(final.get("error") or "") and final.get("results") in (None, "[]"):
                return  # the device left that node while the batch waited there for it: sent on by run_batch
            try:
                results = _RESULTS.validate_json(final.get("results") or "[]")
            except ValueError:
                return
            remote, batch.remote = batch.remote, None  # finished from the reader, not from its task: that task
            try:  # must not be cancelled by it
                hub.finish_remote(batch, results, final.get("error"))
            except Exception:
                batch.remote = remote
                raise
            settled = True

        if route.moved:  # seen elsewhere before the request went: nothing to interrupt yet
            return True
        try:  # no task of its own: the request runs in the batch's task, interrupted by _moved
            final = await self.bus.ask(route.holder, "batch", body, limit, rid=route.rid, on_part=on_part,
                                       on_done=on_done)
        except BusInterrupted:
            return True
        except BusError as exc:
            if NOT_HERE in str(exc):
                return True
            # the request failed, not (as far as anyone here knows) the command on the device
            hub.finish_remote(batch, [], f"node {route.holder} holding device {batch.device} could not be heard "
                                         f"from: {exc}", pending=True)
            return False
        if settled:
            return False
        if NOT_HERE in str(final.get("error") or "") and final.get("results") in (None, "[]"):
            return True  # the device left that node while the batch waited there for it
        try:
            results = _RESULTS.validate_json(final.get("results") or "[]")
        except ValueError as exc:
            hub.finish_remote(batch, [], f"node {route.holder} answered with unreadable results: {exc}")
            return False
        hub.finish_remote(batch, results, final.get("error"))
        return False

    async def cancel(self, nodes: list[str], response_id: str, reason: str) -> bool:
        """Ask each of `nodes` to cancel the batch `response_id`; True when one had it."""
        async def ask(node: str) -> bool:
            try:
                reply = await self.bus.call(node, "cancel", {"response_id": response_id, "reason": reason},
                                            ANSWER_TIMEOUT_S)
            except BusError:
                return False
            return bool(reply.get("cancelled"))

        return any(await asyncio.gather(*(ask(n) for n in nodes if n != self.node)))

    async def request(self, holder: str, device: str, message: ServerMessage, timeout: float) -> ClientMessage:
        """A request frame (a policy request, an outcome query) for `device`, sent by the node `holder` that
        holds it."""
        body = {"device": device, "message": message.model_dump_json(exclude_none=True), "timeout": timeout}
        try:
            reply = await self.bus.call(holder, "request", body, timeout + ANSWER_TIMEOUT_S)
        except BusError as exc:
            raise LookupError(f"device {device} is on node {holder}, which did not answer: {exc}") from None
        if reply.get("timeout"):
            raise TimeoutError(str(reply.get("error") or "no answer"))
        if "error" in reply:
            raise LookupError(str(reply["error"]))
        return ClientMessage.model_validate_json(str(reply.get("answer") or "{}"))

    async def serve_request(self, body: dict[str, Any], send: Any) -> dict[str, Any]:
        message = ServerMessage.model_validate_json(str(body.get("message") or "{}"))
        if message.type not in (ServerMessageType.POLICY_REQUEST, ServerMessageType.POLICY_SET,
                                ServerMessageType.OUTCOME_QUERY):
            raise BusError(f"node {self.node} forwards policy and outcome requests only, not {message.type.value}")
        timeout = min(float(body.get("timeout") or 30.0), 300.0)
        try:
            answer = await self.hub.request(str(body.get("device", "")), message, timeout, here_only=True)
        except LookupError as exc:
            return {"error": str(exc)}
        except TimeoutError:
            return {"error": f"device {body.get('device')} did not answer within {timeout:g}s", "timeout": True}
        return {"answer": answer.model_dump_json()}

    async def answer(self, holder: str, body: dict[str, Any]) -> bool:
        """Answer a question on the node `holder` (`serve_answer`); `ApprovalRefused` when that node refuses
        the answerer the body names."""
        reply = await self.bus.call(holder, "answer", body, ANSWER_TIMEOUT_S)
        if isinstance(reply.get("refused"), str):
            raise ApprovalRefused(reply["refused"])
        return bool(reply.get("answered"))

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the holding node --------------------------------------------------------------------------

    async def serve_batch(self, body: dict[str, Any], send: Callable[[dict[str, Any]], Awaitable[None]]
                          ) -> dict[str, Any]:
        """Another node's batch for a device held here: run it through this hub (never onwards)."""
        hub = self.hub
        device = str(body.get("device", ""))
        message = ServerMessage.model_validate_json(str(body.get("message") or "{}"))
        if message.type is not ServerMessageType.COMMAND:
            raise BusError(f"node {self.node} runs command batches only, not {message.type.value}")
        if not hub.holds(device):
            raise BusError(f"{NOT_HERE}: device {device} is not connected to node {self.node}")
        events: asyncio.Queue[Event | None] | None = None  # made with the first event: most batches have none
        pumper: asyncio.Task[None] | None = None

        async def pump(events: asyncio.Queue[Event | None]) -> None:
            while (event := await events.get()) is not None:
                await send({"event": event.model_dump(mode="json", exclude_none=True)})

        def on_event(event: Event) -> None:  # the pump starts with the first event
            nonlocal pumper, events
            if events is None:
                events = asyncio.Queue()
                pumper = asyncio.create_task(pump(events))
                self._keep(pumper)
            events.put_nowait(event)

        batch = hub.pending(message.response_id)
        if batch is not None and batch.device == device:  # sent here again (the device moved back and forth)
            batch.on_event = on_event
        else:
            batch = await hub.send_batch(device, message, on_event=on_event, here_only=True,
                                         asker=TokenRef.from_dict(body.get("asker")))
            batch.origin = str(body.get("from") or "another node")
        limit = (message.timeout or self.settings.default_command_timeout) + self.settings.grace_period + 5
        try:
            async with asyncio.timeout(limit):
                await batch.done.wait()
        except TimeoutError:
            await hub.cancel(message.response_id, f"node {self.node} timed out after {limit:g}s")
        except asyncio.CancelledError:  # the asking node gave up (its caller's timeout or cancel)
            if pumper is not None:
                pumper.cancel()
            if self.bus.stopping:  # this node stops: the device keeps running it, and the asking node sends
                raise  # it again, same ids, to the node the device moves to (it heard this one leave)
            if hub.holds(device):  # else the device is another node's now, and so is the batch: no CANCEL
                await hub.cancel(message.response_id, "cancelled by the node that sent the batch")
            else:
                hub.finish_remote(batch, [], "cancelled by the node that sent the batch")
            raise
        if pumper is not None and events is not None:  # the events first, then the results, in the device's order
            events.put_nowait(None)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(ANSWER_TIMEOUT_S):
                    await pumper
        self._answered_for(str(body.get("from") or ""), device, message.response_id, batch)
        # the device and batch named too: an answer that comes after the asking node gave up is still recorded
        return {"results": _RESULTS.dump_json(list(batch.results.values())).decode(), "error": batch.error,
                "device": device, "response_id": message.response_id}

    def record_unclaimed(self, body: dict[str, Any]) -> None:
        """An answer to a batch this node gave up waiting for (the backplane was down; its caller was told
        "outcome pending") arrived after all: its outcomes are recorded (`DeviceHub.record_late`)."""
        device, response_id = body.get("device"), body.get("response_id")
        if not isinstance(device, str) or not isinstance(response_id, str) or "results" not in body:
            return
        try:
            results = _RESULTS.validate_json(body.get("results") or "[]")
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
            results = _RESULTS.validate_json(reply.get("results") or "[]")
        except ValueError:
            return
        def then(settled: int) -> None:
            log.warning("batch %s: %d outcome(s) the asking node never heard recorded by node %s",
                        message.response_id, settled, self.node)

        self.store.audit.late(device, [(message.response_id, r.call_id, r.status.value, r.error)
                                       for r in results if r.call_id], then)

    async def serve_cancel(self, body: dict[str, Any], send: Any) -> dict[str, Any]:
        cancelled = await self.hub.cancel(str(body.get("response_id", "")), str(body.get("reason") or "cancelled"))
        return {"cancelled": cancelled}

    async def serve_answer(self, body: dict[str, Any], send: Any) -> dict[str, Any]:
        """Another node's answer to a question of a device held here: checked here too (the answerer the
        body names against the batch's caller) before it goes to the device."""
        content = body.get("content")
        try:
            answered = await self.hub.answer_question(str(body.get("device", "")), str(body.get("question", "")),
                                                      str(body.get("action", "")),
                                                      content if isinstance(content, dict) else None,
                                                      by=str(body.get("by") or "another node"),
                                                      answerer=TokenRef.from_dict(body.get("answerer")))
        except ApprovalRefused as exc:
            return {"refused": str(exc)}
        return {"answered": answered}
