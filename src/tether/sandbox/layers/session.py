"""`SessionTotals`: what one session's sandboxed commands have left on the device, all commands together.

A command's own layer is bounded (`limits.layer_files`, `limits.layer_bytes`); a session — the commands a
caller sends under one session id, or a task's steps — is bounded too, so many small commands cannot add
up to what one large one may not do. The totals count what was applied: the entries a command created
(files, directories, links) and the bytes it wrote (the sizes of what it created or changed). A command
whose changes would take its session over a total is refused before anything is applied, naming the
limit (`limits.session_files`, `limits.session_bytes`); the reservation is taken on the event loop, so two
commands of one session applying at once cannot both slip under it. Commands without a session id are
each their own session (nothing accumulates for them).

Processes are counted while they run: each sandboxed process a session starts (a command, a launched
application that outlives its call) takes its share of `limits.session_processes` — the pid cap of its
own namespace, at most `limits.processes` — and gives it back when it exits. A start that would leave the
session's running processes with less than the kernel's smallest pid cap is refused before anything runs,
naming `limits.session_processes`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from tether.errors import SandboxError

SESSIONS_KEPT = 4096  # sessions whose totals are remembered; the least recently used is forgotten first
SMALLEST_PROCESS_CAP = 300  # a pid namespace cannot be capped lower (its pid_max floor is 301)


class Counted(Protocol):
    """A captured change as far as the totals go (`layer.Change`)."""

    @property
    def kind(self) -> str: ...

    @property
    def bytes(self) -> int: ...


class SessionLimit(SandboxError, RuntimeError):
    """Applying a command's changes would take its session over `rule`; `str()` says by how much."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(detail)
        self.rule = rule


def measure(changes: Iterable[Counted]) -> tuple[int, int]:
    """(entries created, bytes written) of a command's changes."""
    files = written = 0
    for change in changes:
        if change.kind == "created":
            files += 1
        if change.kind != "deleted":
            written += max(0, change.bytes)
    return files, written


class SessionTotals:
    """Files created and bytes written per session id, reserved before an apply and given back if it fails."""

    def __init__(self, kept: int = SESSIONS_KEPT, rows: Iterable[tuple[str, int, int]] = ()) -> None:
        """`rows`: the totals an earlier run kept (`snapshot`), least recently used first."""
        self.kept = kept
        self._totals: OrderedDict[str, tuple[int, int]] = OrderedDict(
            (session, (max(0, files), max(0, written))) for session, files, written in rows)
        while len(self._totals) > kept:
            self._totals.popitem(last=False)
        self._running: dict[str, int] = {}  # session -> process caps its running sandboxed processes hold

    def take_processes(self, session: str | None, wanted: int, total: int) -> int:
        """The process cap a new sandboxed start of `session` gets: `wanted` (the per-command cap; 0: none),
        cut to what the session's `total` has left (0: no session total); `SessionLimit` when less than
        `SMALLEST_PROCESS_CAP` is left. Give it back with `give_back_processes` when the process exits."""
        if not session or not total:
            return wanted
        running = self._running.get(session, 0)
        granted = min(wanted, total - running) if wanted else total - running
        if granted < SMALLEST_PROCESS_CAP:
            raise SessionLimit("limits.session_processes", f"the session's running sandboxed processes hold {running}"
                                                           f" of its {total} processes (limits.session_processes), "
                                                           f"less than the {SMALLEST_PROCESS_CAP} a start needs: it "
                                                           "was not started; nothing was applied")
        self._running[session] = running + granted
        return granted

    def give_back_processes(self, session: str | None, granted: int) -> None:
        """A process `take_processes` granted `granted` to has exited."""
        if session and session in self._running:
            left = self._running[session] - granted
            if left > 0:
                self._running[session] = left
            else:
                del self._running[session]

    def totals(self, session: str | None) -> tuple[int, int]:
        """(files created, bytes written) so far by `session`'s applied commands."""
        return self._totals.get(session, (0, 0)) if session else (0, 0)

    def reserve(self, session: str | None, files: int, written: int, max_files: int, max_bytes: int) -> None:
        """Count a command's (files, bytes) against `session`, or raise `SessionLimit` (nothing counted) when
        that would pass `max_files` or `max_bytes` (0: no limit). No session id: nothing accumulates."""
        if not session:
            return
        had_files, had_bytes = self._totals.get(session, (0, 0))
        if max_files and had_files + files > max_files:
            raise SessionLimit("limits.session_files", f"the session's commands would have created {had_files + files} "
                                                       f"files and directories (limits.session_files: {max_files}; "
                                                       f"{had_files} before this command); nothing was applied")
        if max_bytes and had_bytes + written > max_bytes:
            total = had_bytes + written
            raise SessionLimit("limits.session_bytes", f"the session's commands would have written {total} bytes "
                                                       f"(limits.session_bytes: {max_bytes}; {had_bytes} before this "
                                                       "command); nothing was applied")
        self._totals[session] = (had_files + files, had_bytes + written)
        self._totals.move_to_end(session)
        while len(self._totals) > self.kept:
            self._totals.popitem(last=False)

    def snapshot(self) -> list[tuple[str, int, int]]:
        """Every session's totals as rows (session, files, bytes), least recently used first."""
        return [(session, files, written) for session, (files, written) in self._totals.items()]

    def refund(self, session: str | None, files: int, written: int) -> None:
        """Give back a reservation whose apply did not happen."""
        if session and session in self._totals:
            had_files, had_bytes = self._totals[session]
            self._totals[session] = (max(0, had_files - files), max(0, had_bytes - written))
