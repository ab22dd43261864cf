"""The `sessions` table: who owns each undo session a command may journal into (`tether.server.trust.sessions`)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from tether.server.store.engine import Engine

_SESSION_CACHE = 65_536  # session owners kept in memory (the table is the authority; owners never change)


class Sessions:
    """The `sessions` table of a `Store` (`store.sessions`)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._conn, self._lock, self._writing = engine.conn, engine.lock, engine.writing
        self._rollback = engine.rollback
        self._owners: OrderedDict[str, str] = OrderedDict()

    def claim(self, session_id: str, owner: str) -> str:
        """The owner of `session_id`: `owner` when the session was free (it is theirs from now on),
        else whoever claimed it first. An owner never changes, so known ones are answered from memory."""
        known = self._owners.get(session_id)
        if known is not None:
            return known
        with self._writing(), self._lock:
            self._conn.execute("INSERT OR IGNORE INTO sessions (id, owner, created_at) VALUES (?, ?, ?)",
                               (session_id, owner, time.time()))
            row = self._conn.execute("SELECT owner FROM sessions WHERE id = ?", (session_id,)).fetchone()
        self._remember_owner(session_id, row[0])
        return row[0]

    def known(self, session_id: str) -> str | None:
        """The owner of `session_id` when this server knows it already (from memory, no statement), else None."""
        return self._owners.get(session_id)

    def claim_many(self, claims: Iterable[tuple[str, str]]) -> None:
        """`claim` for many (session_id, owner) pairs in one transaction; taken ones stay as they are."""
        now = time.time()
        rows = [(session_id, owner, now) for session_id, owner in claims]
        if not rows:
            return
        with self._writing(), self._lock:
            self._conn.execute("BEGIN")
            try:
                self._conn.executemany("INSERT OR IGNORE INTO sessions (id, owner, created_at) VALUES (?, ?, ?)",
                                       rows)
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def _remember_owner(self, session_id: str, owner: str) -> None:
        self._owners[session_id] = owner
        while len(self._owners) > _SESSION_CACHE:
            self._owners.popitem(last=False)
