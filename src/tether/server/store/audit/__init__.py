"""`AuditLog`: the `audit` table, the record of every command — who asked, which device, what, and how it ended.

A command's row is written as `sent` before it goes to its device (`sent_grouped`, `sent`) and settled with
its outcome (`done_grouped`, `done`, `done_queued`; `late` for an outcome that came after its caller's wait
ended); rows that are not a command's path are written behind it (`record_soon`) or at once
(`record`, `record_many`). Rows that cannot be written (a full or read-only disk) are held in memory and
retried, and meanwhile `problem` says why, so that the caller refuses commands it could not audit. Reads
(`rows`, `batch`) write what is held first.

With PostgreSQL every statement on the `audit` table runs on the engine's worker thread, on the audit
connection (`Engine.worker`, `Engine.audit_conn`), in the order it was given (with SQLite `Engine.offload` is
off and they run at once, on the caller's thread). The group commits (`sent_grouped`,
`done_grouped`) and the deferred rows (`record_soon`) are handed to it without waiting: the event loop goes
on while the database is slow, locked or gone, and only the callers awaiting those futures wait (at most
`GROUP_TIMEOUT_S`). The other methods wait for the worker. `health` says from state, without a statement,
whether the log can be written; a probe on the worker keeps that state current.

The log is one class built from its parts, each a module of this package: `table` (the rows and their SQL),
`writes` (writing, holding and retrying), `health` (the probe), `group` (the group commit) and `reads`.
"""

from __future__ import annotations

from tether.server.store.audit.group import GROUP_TIMEOUT_S, GroupCommit
from tether.server.store.audit.health import PROBE_INTERVAL_S, PROBE_LOCK_TIMEOUT_MS, PROBE_TIMEOUT_S
from tether.server.store.audit.reads import AuditReads
from tether.server.store.audit.table import LATE_NOTE, PENDING, SENT, UNKNOWN, AuditRow

__all__ = ["GROUP_TIMEOUT_S", "LATE_NOTE", "PENDING", "PROBE_INTERVAL_S", "PROBE_LOCK_TIMEOUT_MS", "PROBE_TIMEOUT_S",
           "SENT", "UNKNOWN", "AuditLog", "AuditRow"]


class AuditLog(GroupCommit, AuditReads):
    """The `audit` table of a `Store` (`store.audit`); see the package's docstring."""
