"""The `tokens` table: API and device tokens, kept as hashes, and the rules of their scopes."""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import logging
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tether.server.store.engine import TOKENS_CHANNEL, Engine
from tether.server.store.pool import StatementPool

logger = logging.getLogger(__name__)

TokenKind = Literal["device", "api"]
# `approve` is apart from `execute` so that an agent holding an execute token cannot approve its own
# dangerous actions: approvals need a token a person holds.
SCOPES = ("read", "execute", "approve", "admin", "sample")  # sample: its commands' MCP servers may use the LLM
AGENT_NEVER = ("approve", "admin")  # scopes an agent's token is never given nor granted
_PREFIX = {"device": "tdev_", "api": "tapi_"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
SCOPE_DEVICE = re.compile(r"^[A-Za-z0-9._@*?\[\]!-]{1,128}$")  # a device name or glob (a token's scope)
SCOPE_TAG = re.compile(r"^[A-Za-z0-9._@:=/+-]{1,128}$")
_MAX_SCOPE_ITEMS = 100
_LAST_USED_EVERY = 60.0  # seconds: verifying a token per API request must not mean a write per request
_TOKEN_CACHE = 65_536  # verified tokens kept in memory (cleared whole when full: it refills from the table)


class TokenInfo(BaseModel):
    """A token's metadata, never its secret: the secret is shown once, at creation, and only its hash is kept."""

    model_config = ConfigDict(frozen=True)

    id: str
    kind: TokenKind
    name: str
    scopes: list[str]
    created_at: float
    revoked_at: float | None = None
    last_used_at: float | None = None
    confirm: str = "never"  # never|destructive|always: plans of the tasks it creates that wait for a person
    # the devices an API token reaches: names or globs, and tags; both empty = every device (docs/security/scopes.md)
    devices: list[str] = []
    tags: list[str] = []
    # an agent's token (`tether token create --agent`, `tether mcp config`): it may read and run, never
    # approve or answer an approval question, whatever scopes its row holds (docs/security/approvals.md)
    agent: bool = False

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    @property
    def scoped(self) -> bool:
        """Whether the token reaches only some devices (`devices`/`tags`), not the whole fleet."""
        return bool(self.devices or self.tags)

    def reaches(self, device: str, tags: Iterable[str] = ()) -> bool:
        """Whether a device of this name and these tags is in the token's scope: an unscoped token reaches
        every device; a scoped one those matching one of its names (or globs) or carrying one of its tags."""
        return scope_reaches(self.devices, self.tags, device, tags)

    def scope_text(self) -> str:
        """The scope in words, for refusals: "devices dev1, lab-*; tags gpu" or "every device"."""
        parts = [f"devices {', '.join(self.devices)}"] if self.devices else []
        parts += [f"tags {', '.join(self.tags)}"] if self.tags else []
        return "; ".join(parts) or "every device"

    def allows(self, scope: str) -> bool:
        """`admin` implies every scope and `execute` implies `read`; an agent's token never holds
        `approve` or `admin` (an admin token could make itself a person's token)."""
        if self.kind != "api":
            return False
        if self.agent and scope in AGENT_NEVER:
            return False
        held = set(self.scopes)
        return scope in held or "admin" in held or (scope == "read" and "execute" in held)


def scope_reaches(devices: Iterable[str], tags: Iterable[str], device: str, device_tags: Iterable[str] = ()) -> bool:
    """Whether a device scope (names or globs, and tags; both empty = every device) reaches a device of
    this name and these tags: the rule `TokenInfo.reaches` applies, for those that keep a token's scope."""
    devices, tags = list(devices), list(tags)
    if not devices and not tags:
        return True
    if any(fnmatch.fnmatchcase(device, p) for p in devices):
        return True
    return bool(tags) and not set(tags).isdisjoint(device_tags)


def hash_token(secret: str) -> str:
    """sha256 hex of the secret.

    A fast hash is the right tool here, unlike for passwords: tokens carry 256 random bits, so
    there is nothing to brute-force, and verification runs on every connection and API request.
    """
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


class Tokens:
    """The `tokens` table of a `Store` (`store.tokens`): create, verify, list and revoke tokens.

    Verified API tokens are answered from memory while nothing may have changed the table (see `verify`).
    """

    def __init__(self, engine: Engine, calls: StatementPool | None = None) -> None:
        """`calls`: where `check` runs a lookup the memory cannot answer (PostgreSQL), None for at once."""
        self._engine = engine
        self._calls = calls
        self._conn, self._lock, self._writing = engine.conn, engine.lock, engine.writing
        # verify's answers by the secret's hash, valid while the database's data_version (bumped by
        # every other connection's commit) and this connection's token writes leave them so
        self._cache: dict[str, TokenInfo] = {}
        self._cache_version = -1
        self._cache_lock = threading.Lock()  # the cache is read on the event loop and filled on `calls`' threads

    def create(self, kind: TokenKind, name: str, scopes: Sequence[str] | None = None,
               confirm: str = "never", *, devices: list[str] | None = None,
               tags: list[str] | None = None, agent: bool = False) -> tuple[TokenInfo, str]:
        """Create a token and return its info and the secret, which is not stored and never shown again.

        A device token's name is the device's identity. Several active tokens per name are allowed
        so a token can be rotated without downtime. An API token gets `read` when no scope is given.
        `devices` (names or globs) and `tags` limit the devices an API token reaches; none = all.
        `agent` makes an API token an agent's: `approve` and `admin` are refused for it (ValueError).
        """
        if kind not in _PREFIX:
            raise ValueError(f"token kind must be 'device' or 'api', not {kind!r}")
        if not _NAME.match(name or ""):
            raise ValueError(f"invalid token name {name!r}: use 1-128 letters, digits, '.', '_', '-' or '@', "
                             "starting with a letter or digit")
        wanted = sorted(set(scopes or []))
        if kind == "device":
            if wanted:
                raise ValueError("device tokens have no scopes; scopes are for API tokens")
        else:
            unknown = [s for s in wanted if s not in SCOPES]
            if unknown:
                raise ValueError(f"unknown scope(s) {', '.join(unknown)}; choose from {', '.join(SCOPES)}")
            wanted = wanted or ["read"]
            if agent and (held := [s for s in wanted if s in AGENT_NEVER]):
                raise ValueError(f"an agent's token cannot have the {', '.join(held)} scope: approving is a "
                                 "person's (give the agent read and execute; a person approves with their own token)")
        if agent and kind != "api":
            raise ValueError("only an API token can be an agent's; a device token is a device's")
        if confirm not in ("never", "destructive", "always"):
            raise ValueError(f"confirm must be never, destructive or always, not {confirm!r}")
        if kind == "device" and confirm != "never":
            raise ValueError("confirm is for API tokens (the tasks they create); a device token creates none")
        reach, labels = _scope_list(devices, SCOPE_DEVICE, "device"), _scope_list(tags, SCOPE_TAG, "tag")
        if kind == "device" and (reach or labels):
            raise ValueError("device tokens have no device or tag scope; those are for API tokens")
        secret = _PREFIX[kind] + secrets.token_urlsafe(32)
        info = TokenInfo(id=secrets.token_hex(6), kind=kind, name=name, scopes=wanted, created_at=time.time(),
                         confirm=confirm, devices=reach, tags=labels, agent=agent)
        with self._writing(), self._lock:
            self._conn.execute(
                "INSERT INTO tokens (id, kind, name, scopes, hash, created_at, confirm, scope_devices, scope_tags, "
                "agent) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (info.id, kind, name, json.dumps(wanted), hash_token(secret), info.created_at, confirm,
                 json.dumps(reach), json.dumps(labels), int(agent)))
        return info, secret

    def verify(self, secret: str) -> TokenInfo | None:
        """The active token whose secret this is, or None (unknown, revoked, or not a token at all). Runs
        statements: on the event loop with PostgreSQL use `check`."""
        if not secret or len(secret) > 512:
            return None
        digest = hash_token(secret)
        # Answered from memory while nothing may have changed the tokens: `PRAGMA data_version` moves
        # when another connection (`tether token revoke`, another process) commits, and this
        # connection's own token writes clear the cache (`changed`), so a revocation is
        # honoured on the very next request. A hit costs one pragma instead of a query and a model.
        with self._lock:
            version = self._version(connect=True)
            cached = self._recall(digest, version)
        now = time.time()
        if cached is not None and (cached.last_used_at is not None and now - cached.last_used_at <= _LAST_USED_EVERY):
            return cached
        with self._lock:
            row = self._conn.execute("SELECT * FROM tokens WHERE hash = ?", (digest,)).fetchone()
            if row is None or not hmac.compare_digest(row["hash"], digest) or row["revoked_at"] is not None:
                return None
            info = _token(row)
            if row["last_used_at"] is None or now - row["last_used_at"] > _LAST_USED_EVERY:
                try:
                    self._conn.execute("UPDATE tokens SET last_used_at = ? WHERE id = ?", (now, row["id"]))
                except sqlite3.OperationalError as exc:  # a full disk must not lock every caller out
                    logger.debug("could not note the use of token %s: %s", row["id"], exc)
                    return info
                info = _token(row, last_used_at=now)
        # a device token is checked once per connection: with SQLite not worth ~1 KiB per device; with
        # PostgreSQL kept, so that devices reconnecting while the tokens table is locked are let in (`check`)
        if info.kind == "api" or self._calls is not None:
            self._keep(digest, info, version)
        return info

    async def check(self, secret: str) -> TokenInfo | None:
        """`verify` without holding up the event loop. With PostgreSQL a token this server verified before is
        answered from memory while no token changed (the `tether_tokens` notifications say so), its
        `last_used_at` noted behind the caller; any other lookup runs on the store's pool (`calls`), so a lock
        on the tokens table delays only the requests with a token not seen before. With SQLite: `verify`."""
        if self._calls is None:
            return self.verify(secret)
        if not secret or len(secret) > 512:
            return None
        digest = hash_token(secret)
        version = self._version(connect=False)  # never waits for the network: no listener is a change
        cached = self._recall(digest, version)
        if cached is None:
            return await self._calls.call(self.verify, secret)
        now = time.time()
        if cached.last_used_at is None or now - cached.last_used_at > _LAST_USED_EVERY:
            cached = cached.model_copy(update={"last_used_at": now})
            self._keep(digest, cached, version)
            self._calls.submit(self._note_use, cached.id, now)
        return cached

    def _note_use(self, token_id: str, now: float) -> None:
        with self._lock:
            self._conn.execute("UPDATE tokens SET last_used_at = ? WHERE id = ?", (now, token_id))

    def _version(self, *, connect: bool) -> int:
        """The token data's version (see `verify`); `connect=False` never opens a connection (PostgreSQL)."""
        if self._engine.dialect == "postgres":
            return int(self._conn.data_version(connect=connect))
        return int(self._conn.execute("PRAGMA data_version").fetchone()[0])

    def _recall(self, digest: str, version: int) -> TokenInfo | None:
        """The cached answer for `digest` if the cache is of `version` (else it is emptied for it)."""
        with self._cache_lock:
            if version != self._cache_version:
                self._cache.clear()
                self._cache_version = version
            return self._cache.get(digest)

    def _keep(self, digest: str, info: TokenInfo, version: int) -> None:
        """Cache `info` if nothing changed the tokens since `version` was read (a lookup that raced a
        revocation keeps nothing)."""
        with self._cache_lock:
            if version != self._cache_version:
                return
            if len(self._cache) >= _TOKEN_CACHE:
                self._cache.clear()
            self._cache[digest] = info

    def changed(self) -> None:
        """This connection wrote to the tokens table (its commits do not move `data_version`); with
        PostgreSQL every other server process is told, at this transaction's commit."""
        with self._cache_lock:
            self._cache.clear()
            self._cache_version = -2  # a lookup begun before this write keeps nothing (`_keep`)
        if self._engine.dialect == "postgres":
            self._conn.execute(f"NOTIFY {TOKENS_CHANNEL}")

    def all(self) -> list[TokenInfo]:
        with self._lock:
            rows = self._conn.execute("SELECT * FROM tokens ORDER BY created_at, id").fetchall()
        return [_token(r) for r in rows]

    def active_ids(self) -> set[str]:
        """Ids of the tokens not revoked: one cheap query, so a running server can notice a revocation
        made by another process (`tether token revoke`)."""
        with self._lock:
            return {r[0] for r in self._conn.execute("SELECT id FROM tokens WHERE revoked_at IS NULL")}

    def active_device_names(self) -> set[str]:
        """Names holding an active device token: a device outside this set cannot connect again."""
        with self._lock:
            return {r[0] for r in self._conn.execute(
                "SELECT DISTINCT name FROM tokens WHERE kind = 'device' AND revoked_at IS NULL")}

    def revoke(self, id_or_name: str) -> int:
        """Revoke the active token with this id, or every active token of this name; returns how many."""
        with self._writing(), self._lock:
            cursor = self._conn.execute(
                "UPDATE tokens SET revoked_at = ? WHERE revoked_at IS NULL AND (id = ? OR name = ?)",
                (time.time(), id_or_name, id_or_name))
            self.changed()
            return cursor.rowcount

    def revoke_device(self, name: str) -> int:
        """Revoke every active device token of `name`; how many."""
        return self._write("UPDATE tokens SET revoked_at = ? WHERE kind = 'device' AND name = ? AND revoked_at IS NULL",
                           (time.time(), name))

    def revoke_id(self, token_id: str) -> int:
        """Revoke the token with this id if it is active (an approval's token undone); how many (0 or 1)."""
        return self._write("UPDATE tokens SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                           (time.time(), token_id))

    def has_active_device(self, name: str) -> bool:
        """Whether `name` has an active device token."""
        return bool(self._engine.read("SELECT 1 FROM tokens WHERE kind = 'device' AND name = ? AND revoked_at IS NULL",
                                      (name,)))

    def _write(self, sql: str, params: Iterable[Any] = ()) -> int:
        """Run one writing statement of the store's tables, noting that the tokens may have changed
        (`changed`, first: pairing revokes tokens); the number of rows it changed. For the tables of
        `tether.server.store` only."""
        with self._writing(), self._lock:
            self.changed()
            return self._conn.execute(sql, tuple(params)).rowcount


def _scope_list(values: list[str] | None, pattern: re.Pattern[str], what: str) -> list[str]:
    """A token's device or tag scope, checked and deduplicated (order kept); ValueError names a bad one."""
    kept = list(dict.fromkeys(v.strip() for v in values or [] if v.strip()))
    if len(kept) > _MAX_SCOPE_ITEMS:
        raise ValueError(f"at most {_MAX_SCOPE_ITEMS} {what} scopes per token, not {len(kept)}")
    for value in kept:
        if not pattern.match(value):
            raise ValueError(f"invalid {what} scope {value[:80]!r}: use letters, digits, '.', '_', '@', '-'"
                             + (" and the wildcards '*', '?', '[...]'" if what == "device" else ""))
    return kept


def _token(row: sqlite3.Row, **override: Any) -> TokenInfo:
    data = {k: row[k] for k in ("id", "kind", "name", "created_at", "revoked_at", "last_used_at", "confirm")}
    data["scopes"] = json.loads(row["scopes"])
    data["devices"] = json.loads(row["scope_devices"] or "[]")
    data["tags"] = json.loads(row["scope_tags"] or "[]")
    data["agent"] = bool(row["agent"])
    data.update(override)
    return TokenInfo(**data)
