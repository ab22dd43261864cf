"""The `pairing` table: requests of devices that enrol without a token and the admin's decisions on them
(the rules are `tether.server.trust.pairing`'s)."""

from __future__ import annotations

import time
from typing import Any

from tether.server.store.engine import Engine
from tether.server.store.tokens import Tokens

PENDING, APPROVED, PAIRED, REFUSED = "pending", "approved", "paired", "refused"


class Pairing:
    """The `pairing` table of a `Store` (`store.pairing`). Rows are read by column name (`row["code"]`)."""

    def __init__(self, engine: Engine, tokens: Tokens) -> None:
        self._engine = engine
        self._tokens = tokens  # its writes note a change of the tokens, as every write beside the tokens' own

    def approved(self) -> list[Any]:
        """The requests approved and not yet claimed: rows of (code, token_id, device_name)."""
        return self._engine.read("SELECT code, token_id, device_name FROM pairing WHERE status = ?", (APPROVED,))

    def reopen(self, code: str) -> None:
        """Put an approved request back to pending, with no token nor device name."""
        self._tokens._write("UPDATE pairing SET status = ?, token_id = NULL, device_name = NULL WHERE code = ?",
                            (PENDING, code))

    def drop_expired(self, now: float) -> None:
        """Forget the pending and refused requests that expired before `now`."""
        self._tokens._write("DELETE FROM pairing WHERE status IN (?, ?) AND expires_at < ?", (PENDING, REFUSED, now))

    def count_pending(self) -> int:
        """How many requests are pending (expired ones included until `drop_expired`)."""
        return int(self._engine.read("SELECT COUNT(*) FROM pairing WHERE status = ?", (PENDING,))[0][0])

    def pending_codes(self, fingerprint: str) -> list[str]:
        """The codes of the pending requests of the key with this fingerprint."""
        rows = self._engine.read("SELECT code FROM pairing WHERE fingerprint = ? AND status = ?",
                                 (fingerprint, PENDING))
        return [row["code"] for row in rows]

    def delete(self, code: str) -> None:
        self._tokens._write("DELETE FROM pairing WHERE code = ?", (code,))

    def add(self, code: str, fingerprint: str, public_key: str, address: str, name: str | None,
            platform: str | None, created_at: float, expires_at: float) -> None:
        """A new pending request."""
        self._tokens._write(
            "INSERT INTO pairing (code, fingerprint, public_key, address, requested_name, platform, created_at, "
            "expires_at, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (code, fingerprint, public_key, address, name, platform, created_at, expires_at, PENDING))

    def mark_paired(self, code: str) -> None:
        """The device claimed the token of its approved request."""
        self._tokens._write("UPDATE pairing SET status = ? WHERE code = ?", (PAIRED, code))

    def get(self, code: str) -> Any | None:
        """The request's row (every column), or None."""
        rows = self._engine.read("SELECT * FROM pairing WHERE code = ?", (code,))
        return rows[0] if rows else None

    def open_requests(self, now: float) -> list[Any]:
        """The pending requests not expired at `now`, oldest first (every column)."""
        return self._engine.read("SELECT * FROM pairing WHERE status = ? AND expires_at >= ? ORDER BY created_at",
                                 (PENDING, now))

    def approve(self, code: str, device_name: str, tags_json: str, token_id: str, by: str) -> int:
        """Mark a pending request approved as `device_name` with its token; 0 when it is no longer pending."""
        return self._tokens._write(
            "UPDATE pairing SET status = ?, device_name = ?, tags = ?, token_id = ?, decided_by = ?, decided_at = ? "
            "WHERE code = ? AND status = ?",
            (APPROVED, device_name, tags_json, token_id, by, time.time(), code, PENDING))

    def refuse(self, code: str, by: str) -> None:
        self._tokens._write("UPDATE pairing SET status = ?, decided_by = ?, decided_at = ? WHERE code = ?",
                            (REFUSED, by, time.time(), code))
