"""`WebSocketCommandDispatcher`: the seed-000 dispatcher for a device on the other end of AIP.

To the agent it looks exactly like `LocalCommandDispatcher`: a list of commands in, one `Result`
per command out, in the same order, with matching `call_id`s — whatever happens on the way. A
cancellation, a device that was never reached or an error on the device become failure results for
exactly the commands that did not finish; a wait that ends while a command may still be running (a
timeout, a device away past its grace period, a backplane outage) becomes "outcome pending"
(`Result.pending`, audited `pending`), and the device's answer is recorded whenever it comes
(docs/outcomes.md). Nothing hangs and nothing raises. Every result is written to the audit log with
who asked.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from tether.protocol.dispatcher import BasicCommandDispatcher
from tether.protocol.messages import Event, ServerMessage, ServerMessageType
from tether.protocol.models import Command, Result, new_call_id
from tether.server.store.audit import PENDING, SENT

if TYPE_CHECKING:
    from tether.server.aip.batches.ledger import PendingBatch, TokenRef
    from tether.server.ports import BatchAudit, BatchSender

logger = logging.getLogger("tether.server.aip.dispatcher")  # the name operators filter on


class WebSocketCommandDispatcher(BasicCommandDispatcher):
    """Runs batches on one named device through a `BatchSender` (the hub), writing their rows to `audit`
    (the store); `default_timeout` is the wait when a call names none; `asker` is the API token the batches
    run for (their MCP servers' questions are its to answer, `PendingBatch.asker`). Build it with
    `hub.dispatcher(...)`."""

    def __init__(self, sender: BatchSender, audit: BatchAudit, device: str, *, default_timeout: float,
                 session_id: str | None = None, agent_name: str | None = None, process_name: str | None = None,
                 root_name: str | None = None, on_event: Callable[[Event], None] | None = None,
                 requested_by: str = "unknown", asker: TokenRef | None = None) -> None:
        self.sender = sender
        self.audit = audit
        self.default_timeout = default_timeout
        self.device = device
        self.session_id = session_id
        self.agent_name = agent_name
        self.process_name = process_name
        self.root_name = root_name
        self.on_event = on_event
        self.requested_by = requested_by
        self.asker = asker
        self._inflight: set[str] = set()

    async def execute_commands(self, commands: list[Command], timeout: float | None = None,
                               early_exit: bool = True, *, response_id: str | None = None,
                               own_timer: bool = True) -> list[Result]:
        """Send `commands` as one batch and wait at most `timeout` seconds (default: the server's
        `default_command_timeout`), including any wait for a device that is reconnecting.

        `response_id` is the batch's id (`DELETE /api/v1/batches/{id}` names it); one is made when
        not given. A caller that tells its callers the id before the batch ends makes it first with
        `new_call_id()`. Cancelling the task that runs this cancels the batch on the device too; the
        cancellation's message, when there is one, is the reason its commands fail with (and the
        audit records).

        `own_timer=False` is for a caller that ends the wait itself, by cancelling, no later than
        `timeout` (a fan-out's one clock): the device is still told `timeout`, but no timer per batch is
        armed here (arming and disarming one was ~6% of the server's CPU in a fan-out to 10,000 devices)."""
        if not commands:
            return []
        timeout = self.default_timeout if timeout is None else timeout
        for command in commands:
            if not command.call_id:
                command.call_id = new_call_id()
        response_id = response_id or new_call_id()
        unaudited = self.audit.problem()
        if unaudited is not None:  # a command that cannot be audited is not run
            return self.generate_error_results(commands, f"not run: {unaudited}")
        repeated = [cid for cid, n in Counter(c.call_id for c in commands).items() if n > 1] \
            if len(commands) > 1 else []
        if repeated:
            results = self.generate_error_results(commands, f"call_id(s) {', '.join(map(str, repeated))} "
                                                            "appear more than once in the batch; nothing was sent")
            self._audit(commands, results, response_id)
            return results
        written = self.audit.sent_grouped(  # one commit with the other batches starting now
            (self.requested_by, self.device, c.call_id, c.tool_name, c.parameters, SENT, None, response_id,
             c.approved_by, c.approval_digest) for c in commands)
        try:  # cancelling this wait leaves the rows queued: the group commit writes them all the same
            unsent = await written
        except asyncio.CancelledError as exc:  # the rows are written anyway: say what became of them
            reason = str(exc.args[0]) if exc.args and exc.args[0] else "cancelled: the caller cancelled the batch"
            self.audit.done_queued((response_id, c.call_id, "failure", f"not sent: {reason}")
                                             for c in commands)
            raise
        if unsent is not None:  # the row must exist before the command can run
            return self.generate_error_results(commands, f"not run: {unsent}")
        message = ServerMessage(type=ServerMessageType.COMMAND, response_id=response_id, actions=list(commands),
                                timeout=timeout, early_exit=early_exit, session_id=self.session_id,
                                agent_name=self.agent_name, process_name=self.process_name,
                                root_name=self.root_name)
        batch: PendingBatch | None = None
        self._inflight.add(response_id)
        try:
            async with asyncio.timeout(timeout if own_timer else None):
                batch = await self.sender.send_batch(self.device, message, on_event=self.on_event, asker=self.asker)
                await batch.done.wait()
        except TimeoutError:  # the device may be running it still: "outcome pending", and it is told to stop
            reason = f"timed out after {timeout:g}s"
            remote = self.sender.remote
            if batch is not None and batch.remote is not None and remote is not None \
                    and (problem := remote.problem()) is not None:  # what is known: the backplane, not the device
                reason += f" ({problem}: node {remote.node} cannot hear from the node holding the device)"
            await self.sender.cancel(response_id, reason, pending=True)
        except asyncio.CancelledError as exc:  # our caller gave up: the device must stop too
            reason = str(exc.args[0]) if exc.args and exc.args[0] else "cancelled: the caller cancelled the batch"
            await self.sender.cancel(response_id, reason)
            self._outcome(commands, self._collect(commands, batch) if batch is not None else
                          self.generate_error_results(commands, reason), response_id)
            raise
        finally:
            self._inflight.discard(response_id)
        results = self._collect(commands, batch) if batch is not None else \
            self.generate_error_results(commands, f"timed out after {timeout:g}s before the batch was sent")
        try:  # grouped with the other batches ending now: one commit for all (AuditLog.done_grouped)
            await self.audit.done_grouped((response_id, c.call_id, _audit_status(r), r.error)
                                                    for c, r in zip(commands, results, strict=True))
        except Exception:
            logger.exception("could not write the audit log for batch %s on %s", response_id, self.device)
        return results

    async def cancel(self) -> None:
        """Cancel this dispatcher's in-flight batches; their callers get what finished plus failures."""
        for response_id in list(self._inflight):
            await self.sender.cancel(response_id, "cancelled")

    def _collect(self, commands: list[Command], batch: PendingBatch) -> list[Result]:
        """One result per command, in command order: the device's, or a failure saying why there is none."""
        results = []
        for command in commands:
            result = batch.results.get(command.call_id or "")
            if result is None and batch.pending:  # the wait ended, not (as far as anyone knows) the command
                result = Result.pending(batch.error or "the wait ended", command.call_id, batch.response_id,
                                        self.device)
            elif result is None:
                [result] = self.generate_error_results([command], batch.error or "no result")
            results.append(result)
        return results

    def _outcome(self, commands: list[Command], results: list[Result], response_id: str) -> None:
        """Write what became of a sent batch into its rows before anyone is told (`AuditLog.done`)."""
        try:
            self.audit.done((response_id, c.call_id, _audit_status(r), r.error)
                                      for c, r in zip(commands, results, strict=True))
        except Exception:
            logger.exception("could not write the audit log for batch %s on %s", response_id, self.device)

    def _audit(self, commands: list[Command], results: list[Result], response_id: str) -> None:
        try:
            self.audit.record_soon(
                (self.requested_by, self.device, c.call_id, c.tool_name, c.parameters, r.status.value, r.error,
                 response_id, c.approved_by, c.approval_digest) for c, r in zip(commands, results, strict=True))
        except Exception:
            logger.exception("could not write the audit log for batch %s on %s", response_id, self.device)


def _audit_status(result: Result) -> str:
    """The audit's status for a caller's result: `pending` for an outcome still to come (`Result.pending`)."""
    return PENDING if result.outcome_pending else result.status.value
