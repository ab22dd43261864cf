"""The `webhooks` and `webhook_deliveries` tables: where notifications go and what became of each one
(the rules are `tether.server.notify`'s). A webhook's secret is read only to sign; no listing returns it."""

from __future__ import annotations

import json
import time
from typing import Any

from tether.server.store.engine import Engine

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"


class Webhooks:
    """The webhook tables of a `Store` (`store.webhooks`). Rows are read by column name (`row["url"]`)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._conn, self._lock, self._writing = engine.conn, engine.lock, engine.writing

    def _write(self, sql: str, params: tuple[Any, ...]) -> int:
        with self._writing(), self._lock:
            return int(self._conn.execute(sql, params).rowcount)

    # -- webhooks ------------------------------------------------------------------------------------

    def add(self, webhook_id: str, url: str, secret: str, events: list[str], fmt: str, owner: str | None,
            source: str) -> None:
        """A new webhook (`owner` a token id, None for the server's own; `source` "api" or "config")."""
        self._write("INSERT INTO webhooks (id, url, secret, events, format, owner, source, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (webhook_id, url, secret, json.dumps(events), fmt, owner, source, time.time()))

    def replace_config(self, hooks: list[tuple[str, str, str, list[str], str]]) -> None:
        """Make the server's configured webhooks exactly `hooks` (id, url, secret, events, format): the
        ones no longer configured go (their deliveries with them), the others are written anew."""
        keep = {hook[0] for hook in hooks}
        for row in self._engine.read("SELECT id FROM webhooks WHERE source = 'config'"):
            if row["id"] not in keep:
                self.remove(row["id"])
        for webhook_id, url, secret, events, fmt in hooks:
            if self._write("UPDATE webhooks SET url = ?, secret = ?, events = ?, format = ? WHERE id = ?",
                           (url, secret, json.dumps(events), fmt, webhook_id)) == 0:
                self.add(webhook_id, url, secret, events, fmt, None, "config")

    def remove(self, webhook_id: str) -> bool:
        """Forget a webhook and its deliveries; False when there was none."""
        self._write("DELETE FROM webhook_deliveries WHERE webhook_id = ?", (webhook_id,))
        return self._write("DELETE FROM webhooks WHERE id = ?", (webhook_id,)) > 0

    def listed(self) -> list[Any]:
        """Every webhook without its secret, oldest first."""
        return self._engine.read("SELECT id, url, events, format, owner, source, created_at FROM webhooks "
                                 "ORDER BY created_at, id")

    def get(self, webhook_id: str) -> Any | None:
        """One webhook without its secret, or None."""
        rows = self._engine.read("SELECT id, url, events, format, owner, source, created_at FROM webhooks "
                                 "WHERE id = ?", (webhook_id,))
        return rows[0] if rows else None

    def secret(self, webhook_id: str) -> str | None:
        """The secret a delivery is signed with (never listed, never logged)."""
        rows = self._engine.read("SELECT secret FROM webhooks WHERE id = ?", (webhook_id,))
        return str(rows[0]["secret"]) if rows else None

    # -- deliveries ----------------------------------------------------------------------------------

    def enqueue(self, delivery_id: str, webhook_id: str, event: str, body: str, now: float) -> None:
        """A delivery to make now."""
        self._write("INSERT INTO webhook_deliveries (id, webhook_id, event, body, status, attempts, next_at, "
                    "created_at, updated_at) VALUES (?, ?, ?, ?, ?, 0, ?, ?, ?)",
                    (delivery_id, webhook_id, event, body, PENDING, now, now, now))

    def due(self, now: float, limit: int) -> list[Any]:
        """Pending deliveries whose time has come, oldest first (every column)."""
        return self._engine.read("SELECT * FROM webhook_deliveries WHERE status = ? AND next_at <= ? "
                                 "ORDER BY next_at LIMIT ?", (PENDING, now, limit))

    def next_due(self) -> float | None:
        """When the next pending delivery is due, or None when none is pending."""
        rows = self._engine.read("SELECT MIN(next_at) AS at FROM webhook_deliveries WHERE status = ?", (PENDING,))
        return float(rows[0]["at"]) if rows and rows[0]["at"] is not None else None

    def claim(self, delivery_id: str, seen_next_at: float, until: float) -> bool:
        """Take a due delivery for sending until `until` (another server sharing the database then leaves
        it); False when someone else took it first."""
        return self._write("UPDATE webhook_deliveries SET next_at = ? WHERE id = ? AND status = ? AND next_at = ?",
                           (until, delivery_id, PENDING, seen_next_at)) == 1

    def settle(self, delivery_id: str, status: str, attempts: int, next_at: float, last_status: int | None,
               last_error: str | None) -> None:
        """Record an attempt: delivered, failed for good, or pending again at `next_at`."""
        self._write("UPDATE webhook_deliveries SET status = ?, attempts = ?, next_at = ?, last_status = ?, "
                    "last_error = ?, updated_at = ? WHERE id = ?",
                    (status, attempts, next_at, last_status, last_error, time.time(), delivery_id))

    def deliveries(self, webhook_id: str | None, limit: int) -> list[Any]:
        """The latest deliveries (of one webhook, or of all), newest first, without their bodies."""
        if webhook_id is None:
            return self._engine.read("SELECT id, webhook_id, event, status, attempts, next_at, last_status, "
                                     "last_error, created_at, updated_at FROM webhook_deliveries "
                                     "ORDER BY created_at DESC LIMIT ?", (limit,))
        return self._engine.read("SELECT id, webhook_id, event, status, attempts, next_at, last_status, "
                                 "last_error, created_at, updated_at FROM webhook_deliveries WHERE webhook_id = ? "
                                 "ORDER BY created_at DESC LIMIT ?", (webhook_id, limit))
