"""`Batch`: one COMMAND message on the device and the state of its results."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tether.device.link.finished import record_key
from tether.protocol.messages import ServerMessage
from tether.protocol.models import Command, Result

# meta tools that only read what the device knows: a batch of these alone never queues
_IMMEDIATE_TOOLS = frozenset({"list_tools"})


@dataclass(eq=False)
class Batch:
    """One COMMAND message and what is known of its results so far (`slots` by position).

    `actions` (its commands, in order; empty for a message without any), `keys` (each command's
    `FinishedRecord` key: the batch's response_id and the command's call_id) and `immediate` (whether it
    may run at once whatever else runs: a tools listing) are fixed by the message: read once, when made."""

    msg: ServerMessage
    slots: list[Result | None] = field(default_factory=list)
    sent: int = 0  # slots[:sent] are in the outbox
    current: int | None = None  # the position of the command that may be running now
    cancel_reason: str | None = None
    task: asyncio.Task[None] | None = None
    deadline: float | None = None  # the loop time at which its timeout fires (counted from its arrival)
    timer: asyncio.TimerHandle | None = None  # fires at `deadline`, queued or running
    done: bool = False
    orphaned: bool = False  # no caller waits for its results any more: the server records them as late outcomes
    position: int = 0  # its place in the queue for a session slot as last reported (0: not waiting)
    actions: list[Command] = field(init=False)
    keys: list[tuple[str, str] | None] = field(init=False)
    immediate: bool = field(init=False)

    def __post_init__(self) -> None:
        actions = self.actions = self.msg.actions or []
        self.slots = [None] * len(actions)
        response_id = self.msg.response_id
        self.keys = [record_key(response_id, c.call_id) for c in actions]
        self.immediate = all(c.tool_name in _IMMEDIATE_TOOLS for c in actions)

    @property
    def session(self) -> str | None:
        """The session the batch runs in (its `session_id`); None: the one session of batches without one."""
        return self.msg.session_id

    def key(self, position: int) -> tuple[str, str] | None:
        """The `FinishedRecord` key of the command at `position`: this batch's response_id and its call_id."""
        return self.keys[position]
