"""The `transfer` skill: a plan step that sends a file or directory from another device to the step's device.

    {"skill": "transfer", "device": "web1", "args": {"from": "build", "source": "~/out/site", "dest": "/srv/site"}}

The step's `device` is the receiver, so the task's undo (which visits every device its steps ran on) puts
the destination back; `from` names the sender. The task service runs it through the server's
`TransferService` (server/aip/transfer) instead of sending it to a device as a command: the receiver's writes
are journaled in the task's session, a destination its policy reserves for a person comes back as a
needs-approval result (the task asks, and the approved step is run again with the digest the person saw),
and a failure names the step and the reason, as any step's does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tether.protocol.models import Command, Result, ToolInfo
from tether.server.aip.transfer.model import TRANSFER_SKILL, Caller, TransferRequest
from tether.server.aip.transfer.service import TransferService

_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "from": {"type": "string", "description": "the device the file or directory is on now"},
        "source": {"type": "string", "description": "its path there"},
        "dest": {"type": "string", "description": "where it goes on this step's device (an existing directory "
                                                  "receives it by its name)"},
        "overwrite": {"type": "boolean", "default": False, "description": "replace files already there"},
    },
    "required": ["from", "source", "dest"],
    "additionalProperties": False,
}


def transfer_tool() -> ToolInfo:
    """How the skill looks to planners and the plan check: an action on the receiving device."""
    return ToolInfo(name=TRANSFER_SKILL, namespace="tether", tool_type="action", input_schema=_SCHEMA,
                    description="Send a file or directory from the device named in `from` to this step's device "
                                "(streamed in checked chunks, written under this device's policy, undoable).")


def is_transfer(commands: list[Command]) -> bool:
    """Whether a step's batch is the transfer skill (one command named `transfer`)."""
    return len(commands) == 1 and commands[0].tool_name == TRANSFER_SKILL


async def run_transfer_step(service: TransferService, command: Command, device: str, *, session_id: str | None,
                            requested_by: str, reaches: Callable[[str], bool], timeout: float | None) -> Result:
    """Run one transfer step to `device`; never raises. `reaches(name)`: whether the task may use the sender."""
    args = command.parameters or {}
    bad = [k for k in ("from", "source", "dest") if not isinstance(args.get(k), str) or not args.get(k)]
    extra = sorted(set(args) - set(_SCHEMA["properties"]))
    if bad or extra or not isinstance(args.get("overwrite", False), bool):
        problem = (f"missing or empty argument(s) {', '.join(bad)}" if bad else
                   f"unknown argument(s) {', '.join(extra)}" if extra else "argument 'overwrite' must be a boolean")
        return Result.failure(f"{TRANSFER_SKILL}: invalid arguments: {problem}", command.call_id)
    source = str(args["from"])
    if not reaches(source):
        return Result.failure(f"{TRANSFER_SKILL}: device '{source}' is outside the scope of the token that created "
                              "the task", command.call_id)
    caller = Caller(requested_by=requested_by, session_id=session_id, approved_by=command.approved_by,
                    approval_digest=command.approval_digest)
    request = TransferRequest(source, str(args["source"]), device, str(args["dest"]),
                              overwrite=bool(args.get("overwrite", False)))
    try:
        async with asyncio.timeout(timeout):
            result = await service.transfer(request, caller)
    except TimeoutError:
        result = Result.failure(f"{TRANSFER_SKILL}: timed out after {timeout:g}s; asking again resumes from what "
                                "arrived")
    return result.model_copy(update={"call_id": command.call_id})
