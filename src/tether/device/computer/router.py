"""`CommandRouter`: validates and runs a batch of commands on the right `Computer` (seeds 000, 003).

Whatever goes wrong — unknown agent, unknown tool, bad arguments, a tool that crashes — comes back
as a failure `Result` for exactly that command; nothing is raised out of `execute`. With
`early_exit`, the commands after a failure are not run and come back `skipped`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from tether.device.computer.manager import ComputerManager
from tether.protocol.models import Command, Result, ResultStatus
from tether.tools.context import EventSink
from tether.tools.policy import approval

logger = logging.getLogger(__name__)


class CommandRouter:
    def __init__(self, computer_manager: ComputerManager) -> None:
        self.computer_manager = computer_manager

    async def execute(self, agent_name: str | None, process_name: str | None, root_name: str | None,
                      commands: Sequence[Command], early_exit: bool = True, *,
                      session_id: str | None = None, emit: EventSink | None = None,
                      on_result: Callable[[Result], None] | None = None,
                      deadline: float | None = None) -> list[Result]:
        """Run `commands` in order; `on_result` sees each result as soon as it exists, so a caller
        that gives up (a timeout) still keeps the results that were finished. `deadline`: the loop
        time at which the caller's own timeout stops the commands anyway (see `ToolContext.deadline`)."""
        # an existing computer without the await (the hot path); get_or_create builds one, or says why not
        computer = self.computer_manager.get_existing(agent_name, process_name, root_name)
        try:
            if computer is None:
                computer = await self.computer_manager.get_or_create(agent_name, process_name, root_name)
        except ValueError as exc:  # e.g. an agent name the device's config does not know
            failures = [Result.failure(str(exc), c.call_id) for c in commands]
            for failure in failures:
                if on_result is not None:
                    on_result(failure)
            return failures
        base = computer.context
        results: list[Result] = []
        failed: Command | None = None
        for command in commands:
            if failed is not None:
                skipped = Result(status=ResultStatus.SKIPPED, call_id=command.call_id,
                                 error=f"skipped: earlier command '{failed.tool_name}' ({failed.call_id}) failed")
                results.append(skipped)
                if on_result is not None:
                    on_result(skipped)
                continue
            started = time.monotonic()
            try:
                try:
                    call = computer.command2tool(command)
                except ValueError:
                    if not computer.still_starting:
                        raise
                    if emit is not None:  # an external server's tool, maybe: said, then waited for
                        emit("starting", {"call_id": command.call_id, "servers": list(computer.still_starting)})
                    call = await computer.command2tool_when_joined(command, deadline)
            except ValueError as exc:
                result = Result.failure(str(exc), command.call_id)
            else:
                ctx = base.for_call(session_id=session_id or base.session_id, call_id=command.call_id,
                                    approved_by=command.approved_by, emit=emit, deadline=deadline)
                if command.approval_digest:  # approved for what the person saw: is it still that?
                    ctx = approval.bind(ctx, command)
                result = await computer.run_action(call, ctx)
                if not result.ok and isinstance(result.result, dict) and result.result.get("needs_approval"):
                    result = approval.mark(result, command)  # the digest of what the person is asked about
            took = time.monotonic() - started
            results.append(result)
            if on_result is not None:  # the result goes on its way first, the log line after it
                on_result(result)
            if logger.isEnabledFor(logging.INFO):  # a service's log: one line per command (cheap when off)
                _log_command(command, result, agent_name, session_id, took)
            if early_exit and result.status is ResultStatus.FAILURE:
                failed = command
        return results


def _log_command(command: Command, result: Result, caller: str | None, session: str | None, took: float) -> None:
    ms = round(took * 1000, 1)
    status = result.status.value
    logger.info("command %s by %s: %s in %.0f ms", command.tool_name, caller or "-", status, ms,
                extra={"tool": command.tool_name, "caller": caller, "session": session,
                       "status": status, "duration_ms": ms, "call_id": command.call_id})
