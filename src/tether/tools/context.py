"""What a built-in tool may know about the call it serves: policy, journal, session, approval, events."""

from __future__ import annotations

import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tether.tools.policy.model import Policy, default_policy

if TYPE_CHECKING:
    from tether.sandbox.runner import Sandbox
    from tether.tools.journal import UndoJournal

EventSink = Callable[[str, dict[str, Any]], None]
# puts a question to a person while a call waits: (question id, message, answer schema) -> (action, content),
# action "accept" | "decline" | "cancel"; the caller emits the question's event on its call and bounds the wait
PersonAsker = Callable[[str, str, dict[str, Any]], Awaitable[tuple[str, dict[str, Any] | None]]]


class HeldApproval(Protocol):
    """An approval that may be for a command's held changes (`tether.tools.policy.approval.ApprovalClaim`): who
    approved, and whether a held change list (by its digest) is the one that person saw. A Protocol
    here, so that the context does not import the module that digests what it approves."""

    @property
    def by(self) -> str: ...

    def matches(self, changes_digest: str | None) -> bool: ...


def _no_events(kind: str, data: dict[str, Any]) -> None:
    return None


def default_state_dir() -> Path:
    """Where a device keeps its journal and records: $TETHER_STATE_DIR or ~/.local/state/tether."""
    import os

    env = os.environ.get("TETHER_STATE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tether"


@dataclass(frozen=True, slots=True)
class ToolContext:
    """Passed to built-in tools whose signature asks for `ctx`; one per device, narrowed per call."""

    policy: Policy = field(default_factory=default_policy)
    journal: UndoJournal | None = None
    session_id: str | None = None
    call_id: str | None = None
    approved_by: str | None = None
    emit: EventSink = _no_events
    temp_dir: str = field(default_factory=tempfile.gettempdir)
    # the event-loop time by which the caller stops this call anyway (its batch's timeout): a tool's
    # own time limit that would end later need not be armed (`tether.tools.runtime.call_spec`)
    deadline: float | None = None
    # the device's OS sandbox (None: processes run unconfined, allowed only if the policy says so)
    sandbox: Sandbox | None = None
    # the device's own hidden paths (state directory, token file, config): hidden from every tool like
    # the policy's hide_paths, whether or not the device has a sandbox
    secrets: tuple[str, ...] = ()
    # an approval whose digest was not the command's alone: maybe for changes it held (tools/policy/approval.py)
    approval: HeldApproval | None = None
    # how the device asks a person during a call (a sandboxed command's unlisted host, `ask: on-miss`); None:
    # nobody can be asked here
    ask_person: PersonAsker | None = None

    def for_call(self, *, session_id: str | None, call_id: str | None, approved_by: str | None,
                 emit: EventSink | None = None, deadline: float | None = None) -> ToolContext:
        # `replace` would do, at several times the cost, on every command
        return type(self)(self.policy, self.journal, session_id, call_id, approved_by, emit or self.emit,
                          self.temp_dir, deadline, self.sandbox, self.secrets, None, self.ask_person)
