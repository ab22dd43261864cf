"""The asking node's side of a crossing batch: sent to the node holding its device, followed when the
device moves, answered here (see the package's docstring)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

from tether.protocol.messages import ClientMessage, Event, ServerMessage
from tether.server.cluster.bus import BusError, BusInterrupted
from tether.server.cluster.routing.core import (
    ANSWER_TIMEOUT_S,
    ANSWERED_MEMORY,
    MAX_REROUTES,
    NOT_HERE,
    RESULTS,
    Route,
    RouterCore,
    log,
)
from tether.server.trust.approvals import ApprovalRefused

if TYPE_CHECKING:
    from tether.server.aip.batches.ledger import PendingBatch


class AskingSide(RouterCore):
    """`Router`'s methods for batches and requests this node sends to the nodes holding their devices."""

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
                results = RESULTS.validate_json(final.get("results") or "[]")
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
            results = RESULTS.validate_json(final.get("results") or "[]")
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

    async def answer(self, holder: str, body: dict[str, Any]) -> bool:
        """Answer a question on the node `holder` (`serve_answer`); `ApprovalRefused` when that node refuses
        the answerer the body names."""
        reply = await self.bus.call(holder, "answer", body, ANSWER_TIMEOUT_S)
        if isinstance(reply.get("refused"), str):
            raise ApprovalRefused(reply["refused"])
        return bool(reply.get("answered"))
