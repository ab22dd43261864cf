"""`Store`: the agent server's durable state in one SQLite file — tokens, known devices, the audit log.

One connection in WAL mode, guarded by a lock so the few callers that move work to a thread stay
safe; every call is a short statement, cheap enough to run on the event loop. The schema is
versioned (`schema_version`) and grows by appending to `_MIGRATIONS`, so later issues add tables
without touching existing rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fnmatch
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tether.server.store.engine import (
    TOKENS_CHANNEL,
    StoreUnavailable,
    describe,
    dialect_of,
    is_url,
    open_postgres,
    pick,
    schema_transaction,
    split_script,
)

logger = logging.getLogger(__name__)

TokenKind = Literal["device", "api"]
# `approve` is apart from `execute` so that an agent holding an execute token cannot approve its own
# dangerous actions: approvals need a token a person holds.
SCOPES = ("read", "execute", "approve", "admin")
AGENT_NEVER = ("approve", "admin")  # scopes an agent's token is never given nor granted
_PREFIX = {"device": "tdev_", "api": "tapi_"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
SCOPE_DEVICE = re.compile(r"^[A-Za-z0-9._@*?\[\]!-]{1,128}$")  # a device name or glob (a token's scope)
SCOPE_TAG = re.compile(r"^[A-Za-z0-9._@:=/+-]{1,128}$")
_MAX_SCOPE_ITEMS = 100
_MAX_ARGUMENTS_CHARS = 16_384
_LAST_USED_EVERY = 60.0  # seconds: verifying a token per API request must not mean a write per request
_AUDIT_FLUSH_S = 0.05  # deferred audit rows are written at most this late, in one transaction
_AUDIT_FLUSH_ROWS = 64  # ... or as soon as this many are waiting
_AUDIT_HELD_MAX = 100_000  # rows kept in memory while the log cannot be written (then the oldest go, logged)
_AUDIT_RETRY_S = 1.0  # while the log cannot be written, held rows are retried this often (and before each batch)
MIN_FREE_BYTES = 1 << 20  # less free space than this in the state directory counts as a full disk

# requested_by, device, call_id, tool_name, arguments, status, error, response_id[, approved_by[, approval_digest]]
AuditRow = tuple[Any, ...]

# One migration path for both databases: a text both read (the engine rewrites SQLite's few spellings for
# PostgreSQL: REAL, AUTOINCREMENT, `?`), or {"sqlite": …, "postgres": …} where they must differ.
_MIGRATIONS: list[str | dict[str, str]] = [
    """
    CREATE TABLE tokens (
        id TEXT PRIMARY KEY,
        kind TEXT NOT NULL CHECK (kind IN ('device', 'api')),
        name TEXT NOT NULL,
        scopes TEXT NOT NULL DEFAULT '[]',
        hash TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL,
        revoked_at REAL,
        last_used_at REAL
    );
    CREATE INDEX tokens_name ON tokens (name);
    CREATE TABLE devices (
        name TEXT PRIMARY KEY,
        profile TEXT,
        first_seen REAL NOT NULL,
        last_seen REAL NOT NULL
    );
    CREATE TABLE audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        requested_by TEXT NOT NULL,
        device TEXT NOT NULL,
        response_id TEXT,
        call_id TEXT,
        tool_name TEXT NOT NULL,
        arguments TEXT NOT NULL,
        status TEXT NOT NULL,
        error TEXT
    );
    CREATE INDEX audit_device ON audit (device, id);
    """,
    # who approved a command the policy wanted a person for (the token, or the task's approver)
    """
    ALTER TABLE audit ADD COLUMN approved_by TEXT;
    """,
    # who owns each undo session a command may journal into (see tether.server.sessions)
    """
    CREATE TABLE sessions (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    """,
    # a command's row is written as 'sent' before it goes and updated with its outcome (audit_sent/done)
    """
    CREATE INDEX audit_batch ON audit (response_id, call_id);
    CREATE INDEX audit_sent ON audit (status) WHERE status = 'sent';
    """,
    # pairing requests of devices that enrol without a token (see tether.server.pairing)
    """
    CREATE TABLE pairing (
        code TEXT PRIMARY KEY,
        fingerprint TEXT NOT NULL,
        address TEXT NOT NULL,
        requested_name TEXT,
        platform TEXT,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        status TEXT NOT NULL,
        device_name TEXT,
        tags TEXT NOT NULL DEFAULT '[]',
        token_id TEXT,
        decided_by TEXT,
        decided_at REAL
    );
    CREATE INDEX pairing_status ON pairing (status, expires_at);
    """,
    # which plans of the tasks an API token creates wait for a person's confirmation (tether.agent.confirm)
    """
    ALTER TABLE tokens ADD COLUMN confirm TEXT NOT NULL DEFAULT 'never';
    """,
    # known devices read at start-up without their profiles (issue 13): a device's tool list is kept once
    # per distinct content, and its platform and tags beside the name so listing needs no profile
    {"sqlite": """
    CREATE TABLE device_tools (digest TEXT PRIMARY KEY, tools TEXT NOT NULL);
    ALTER TABLE devices ADD COLUMN tools_digest TEXT;
    ALTER TABLE devices ADD COLUMN platform TEXT;
    ALTER TABLE devices ADD COLUMN tags TEXT;
    UPDATE devices SET platform = json_extract(profile, '$.os.platform'), tags = json_extract(profile, '$.tags')
        WHERE profile IS NOT NULL AND json_valid(profile);
    """, "postgres": """
    CREATE TABLE device_tools (digest TEXT PRIMARY KEY, tools TEXT NOT NULL);
    ALTER TABLE devices ADD COLUMN tools_digest TEXT;
    ALTER TABLE devices ADD COLUMN platform TEXT;
    ALTER TABLE devices ADD COLUMN tags TEXT
    """},
    # a command's outcome finds its `sent` row through an index of the rows still in flight (issue 13): the
    # index of every row by (response_id, call_id) took each insert to a random leaf of a tree as large as
    # the log — one more page written per command, ~11% of the server's CPU per REST command
    # (bench/fleet_hotpath.py) — and it was read for nothing else. This one holds only the `sent` rows (a
    # row leaves it when its outcome is written), so it stays a few pages; it also serves the start-up's
    # settling of rows left `sent` (`settle_sent`), which `audit_sent` did.
    """
    DROP INDEX audit_batch;
    DROP INDEX audit_sent;
    CREATE INDEX audit_inflight ON audit (response_id, call_id) WHERE status = 'sent';
    """,
    # which devices an API token reaches (issue 27, docs/security/scopes.md): device names or globs and
    # device tags, JSON lists; both empty = every device, as before
    """
    ALTER TABLE tokens ADD COLUMN scope_devices TEXT NOT NULL DEFAULT '[]';
    ALTER TABLE tokens ADD COLUMN scope_tags TEXT NOT NULL DEFAULT '[]';
    """,
    # whose a token is (issue 27): a person's (agent = 0, what every token made before is) or an agent's (1),
    # which never approves; and the digest of what the person who approved a command was shown
    """
    ALTER TABLE tokens ADD COLUMN agent INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE audit ADD COLUMN approval_digest TEXT;
    """,
    # a device is its key (issue 27): each device's Ed25519 public key, proved at every registration
    # (tether.server.device_keys); a pairing request carries the key that asks
    """
    CREATE TABLE device_keys (
        name TEXT PRIMARY KEY,
        public_key TEXT NOT NULL,
        enrolled_at REAL NOT NULL,
        enrolled_by TEXT NOT NULL
    );
    ALTER TABLE pairing ADD COLUMN public_key TEXT;
    """,
    # outcomes that come late (issue 28, docs/outcomes.md): a row whose caller's wait ended while the command
    # may still run is `pending` (or `unknown` after a restart) until the device's result settles it; this
    # index holds only those rows, as `audit_inflight` holds the `sent` ones, so it stays small
    """
    CREATE INDEX audit_unsettled ON audit (response_id, call_id) WHERE status IN ('pending', 'unknown');
    """,
]
SENT, UNKNOWN, PENDING = "sent", "unknown", "pending"
LATE_NOTE = "late: this outcome came back after the caller's wait had ended"
_BATCH_WINDOW = 200_000  # GET /batches/{id} looks for a batch's rows among the newest this many audit rows
_TOKEN_CACHE = 65_536  # verified tokens kept in memory (cleared whole when full: it refills from the table)
_SESSION_CACHE = 65_536  # session owners kept in memory (the table is the authority; owners never change)


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


class StoredDevice(BaseModel):
    name: str
    profile: dict[str, Any] | None
    first_seen: float
    last_seen: float


_SQLITE_READONLY, _SQLITE_IOERR, _SQLITE_FULL, _SQLITE_CANTOPEN = 8, 10, 13, 14


def disk_problem(exc: BaseException, where: str | Path) -> str | None:
    """One line saying why `exc` means the state at `where` cannot be written, or None when it is not
    that kind of error (a bug, a constraint)."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    number = exc.errno if isinstance(exc, OSError) else None
    text = str(exc).replace("\n", " ")
    if primary == _SQLITE_FULL or number in (errno.ENOSPC, errno.EDQUOT) or "disk is full" in text:
        return f"disk full: cannot write {where} ({text})"
    if primary == _SQLITE_READONLY or number == errno.EROFS or "readonly" in text or "read-only" in text:
        return f"read-only disk: cannot write {where} ({text})"
    if primary == _SQLITE_IOERR or number == errno.EIO:
        # SQLite reports a full disk met while sizing its shared-memory file as an I/O error
        full = free_space_problem(Path(where).parent)
        return f"{full} ({text})" if full else f"disk I/O error: cannot write {where} ({text})"
    if primary == _SQLITE_CANTOPEN or number in (errno.EACCES, errno.EPERM):
        return f"cannot open {where} for writing ({text})"
    return None


def free_space_problem(directory: str | Path, minimum: int = MIN_FREE_BYTES) -> str | None:
    """A full-disk message when `directory` has less than `minimum` bytes free (what this process may
    use: root may use the blocks reserved for it), else None."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None  # a directory that cannot be examined is reported by the write that fails
    blocks = stats.f_bfree if os.geteuid() == 0 else stats.f_bavail
    free = blocks * stats.f_frsize
    if free >= minimum:
        return None
    return f"disk full: {directory} has {free // 1024} KiB free (the server needs at least {minimum // 1024} KiB)"


def check_state_dir(db_path: str | Path) -> None:
    """Raise `StoreUnavailable` (one line) unless the server's database at `db_path` opens, can be
    written and has room beside it: a server checks this before it starts."""
    store = Store(db_path)
    try:
        store.check_writable()
    finally:
        with contextlib.suppress(sqlite3.Error):
            store.close()


def hash_token(secret: str) -> str:
    """sha256 hex of the secret.

    A fast hash is the right tool here, unlike for passwords: tokens carry 256 random bits, so
    there is nothing to brute-force, and verification runs on every connection and API request.
    """
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


class Store:
    def __init__(self, path: str | Path) -> None:
        """Open (or create) the database; `StoreUnavailable` says in one line when its directory cannot
        be written (full, read-only, no permission)."""
        self.where = describe(path)  # for messages: a URL's password masked
        self.path = Path(self.where)
        self._directory = str(self.path.parent)
        self._free_space_turn: tuple[str | None] | None = None  # this loop turn's free_space_problem
        self._lock = threading.Lock()
        self._audit_pending: list[tuple[str, str, str | None, str, dict[str, Any] | None, str, str | None,
                                        str | None, float]] = []
        self._audit_flush: asyncio.TimerHandle | None = None
        self._audit_error: str | None = None  # why held rows could not be written; None while all is written
        self._audit_dropped = 0
        self._audit_updates: list[tuple[str, str | None, str, str | None]] = []  # outcomes not yet written
        self._audit_waiters: list[asyncio.Future[None]] = []  # callers of audit_done_grouped
        self._sent_pending: list[tuple[Any, ...]] = []  # rows of audit_sent_grouped for the next group commit
        self._sent_waiters: list[asyncio.Future[str | None]] = []
        self._audit_tick: asyncio.Handle | None = None
        self._session_owners: OrderedDict[str, str] = OrderedDict()
        # verify_token's answers by the secret's hash, valid while the database's data_version (bumped by
        # every other connection's commit) and this connection's token writes leave them so
        self._token_cache: dict[str, TokenInfo] = {}
        self._token_cache_version = -1
        # nothing on this machine's disk to check for a database elsewhere (PostgreSQL) or in memory
        self._memory = str(path) == ":memory:" or is_url(path)
        self._conn: Any
        try:
            if is_url(path):
                self._conn = open_postgres(str(path))
            else:
                if not self._memory:
                    self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
                self._conn.row_factory = sqlite3.Row
                if not self._memory:
                    self.path.chmod(0o600)
            self.dialect = dialect_of(self._conn)
            with self._lock:
                if self.dialect == "sqlite":
                    self._conn.execute("PRAGMA journal_mode=WAL")
                    self._conn.execute("PRAGMA synchronous=NORMAL")
                    self._conn.execute("PRAGMA foreign_keys=ON")
                self._migrate()
        except (sqlite3.Error, OSError) as exc:
            with contextlib.suppress(Exception):
                self._conn.close()
            raise StoreUnavailable(disk_problem(exc, self.path) or f"cannot open {self.where}: {exc}") from None

    def check_writable(self) -> None:
        """Raise `StoreUnavailable` (one line) unless the database can be written and its disk has room:
        what a server checks before it starts."""
        if self._memory:
            if self.dialect == "postgres":  # reachable and writable: one empty transaction
                with self._writing(), self._lock:
                    self._conn.execute("BEGIN")
                    self._conn.execute("ROLLBACK")
            return
        problem = free_space_problem(self.path.parent)
        if problem is not None:
            raise StoreUnavailable(problem)
        with self._writing(), self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("ROLLBACK")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A write whose failure for lack of a writable disk becomes `StoreUnavailable`."""
        try:
            yield
        except sqlite3.Error as exc:
            problem = disk_problem(exc, self.path)
            if problem is None:
                raise
            raise StoreUnavailable(problem) from None

    def _migrate(self) -> None:
        """Bring the schema to this tether's version in one transaction under the schema lock
        (`schema_transaction`): servers starting at once on a fresh database migrate it once, one after
        the other, and the later ones find it current."""
        # a current schema is read without the lock (a reader of a read-only state directory opens it too)
        if self.dialect == "sqlite":
            exists = self._conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'schema_version'").fetchone()
        else:
            exists = self._conn.execute("SELECT to_regclass('schema_version')").fetchone()[0]
        if exists and self._version() == len(_MIGRATIONS):
            return
        with schema_transaction(self._conn):
            self._conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            current = self._version()
            if current > len(_MIGRATIONS):
                raise RuntimeError(f"{self.where} has schema version {current}, newer than this tether "
                                   f"({len(_MIGRATIONS)}); upgrade tether or use another --db")
            for version in range(current + 1, len(_MIGRATIONS) + 1):
                for statement in split_script(pick(_MIGRATIONS[version - 1], self.dialect)):
                    self._conn.execute(statement)
                self._conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))

    def _version(self) -> int:
        row = self._conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0] or 0)

    def _rollback(self) -> None:
        """Roll back the open transaction, if SQLite has not already (it does after a full disk)."""
        if self._conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")

    @property
    def schema_version(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]

    def close(self) -> None:
        if not self.flush_audit():
            if self._audit_flush is not None:
                self._audit_flush.cancel()
                self._audit_flush = None
            logger.error("closing with %d audit row(s) that could not be written: %s", len(self._audit_pending),
                         self._audit_error)
        with self._lock:
            self._conn.close()

    # -- tokens ----------------------------------------------------------------------------------

    def create_token(self, kind: TokenKind, name: str, scopes: Iterable[str] | None = None,
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

    def verify_token(self, secret: str) -> TokenInfo | None:
        """The active token whose secret this is, or None (unknown, revoked, or not a token at all)."""
        if not secret or len(secret) > 512:
            return None
        digest = hash_token(secret)
        with self._lock:
            # Answered from memory while nothing may have changed the tokens: `PRAGMA data_version` moves
            # when another connection (`tether token revoke`, another process) commits, and this
            # connection's own token writes clear the cache (`_tokens_changed`), so a revocation is
            # honoured on the very next request. A hit costs one pragma instead of a query and a model.
            version = (self._conn.data_version() if self.dialect == "postgres"
                       else self._conn.execute("PRAGMA data_version").fetchone()[0])
            if version != self._token_cache_version:
                self._token_cache.clear()
                self._token_cache_version = version
            cached = self._token_cache.get(digest)
            now = time.time()
            if cached is not None and (cached.last_used_at is not None
                                       and now - cached.last_used_at <= _LAST_USED_EVERY):
                return cached
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
            if info.kind != "api":  # a device token is checked once per connection: not worth ~1 KiB per device
                return info
            if len(self._token_cache) >= _TOKEN_CACHE:
                self._token_cache.clear()
            self._token_cache[digest] = info
        return info

    def _tokens_changed(self) -> None:
        """This connection wrote to the tokens table (its commits do not move `data_version`); with
        PostgreSQL every other server process is told, at this transaction's commit."""
        self._token_cache.clear()
        if self.dialect == "postgres":
            self._conn.execute(f"NOTIFY {TOKENS_CHANNEL}")

    def list_tokens(self) -> list[TokenInfo]:
        with self._lock:
            rows = self._conn.execute("SELECT * FROM tokens ORDER BY created_at, id").fetchall()
        return [_token(r) for r in rows]

    def active_token_ids(self) -> set[str]:
        """Ids of the tokens not revoked: one cheap query, so a running server can notice a revocation
        made by another process (`tether token revoke`)."""
        with self._lock:
            return {r[0] for r in self._conn.execute("SELECT id FROM tokens WHERE revoked_at IS NULL")}

    def revoke_token(self, id_or_name: str) -> int:
        """Revoke the active token with this id, or every active token of this name; returns how many."""
        with self._writing(), self._lock:
            cursor = self._conn.execute(
                "UPDATE tokens SET revoked_at = ? WHERE revoked_at IS NULL AND (id = ? OR name = ?)",
                (time.time(), id_or_name, id_or_name))
            self._tokens_changed()
            return cursor.rowcount

    # -- for the server's other modules (pairing, …): one statement, under the same lock ----------

    def write(self, sql: str, params: Iterable[Any] = ()) -> int:
        """Run one writing statement; the number of rows it changed."""
        with self._writing(), self._lock:
            self._tokens_changed()  # any statement may touch the tokens (pairing revokes some)
            return self._conn.execute(sql, tuple(params)).rowcount

    def read(self, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, tuple(params)).fetchall()

    # -- devices ---------------------------------------------------------------------------------

    def upsert_device(self, name: str, profile_json: str | None, last_seen: float, *,
                      tools: tuple[str, str | bytes] | None = None) -> None:
        """Remember a device; `profile_json=None` keeps the profile already stored. `tools` is (digest,
        JSON) of a tool list kept apart from `profile_json` (which then holds no `tools`), once per digest."""
        with self._writing(), self._lock:
            if tools is not None:
                self._conn.execute("INSERT OR IGNORE INTO device_tools (digest, tools) VALUES (?, ?)",
                                   (tools[0], tools[1].decode() if isinstance(tools[1], bytes) else tools[1]))
            self._conn.execute(
                "INSERT INTO devices (name, profile, first_seen, last_seen, tools_digest, platform, tags) "
                "VALUES (:name, :profile, :seen, :seen, :digest, json_extract(:profile, '$.os.platform'), "
                "json_extract(:profile, '$.tags')) "
                "ON CONFLICT (name) DO UPDATE SET profile = COALESCE(excluded.profile, devices.profile), "
                "tools_digest = CASE WHEN excluded.profile IS NULL THEN devices.tools_digest "
                "ELSE excluded.tools_digest END, "
                "platform = CASE WHEN excluded.profile IS NULL THEN devices.platform ELSE excluded.platform END, "
                "tags = CASE WHEN excluded.profile IS NULL THEN devices.tags ELSE excluded.tags END, "
                "last_seen = excluded.last_seen",
                {"name": name, "profile": profile_json, "seen": last_seen, "digest": tools[0] if tools else None})

    def list_devices(self) -> list[StoredDevice]:
        """Every known device with its whole profile (tools put back): for tools and tests, not start-up."""
        with self._lock:
            rows = self._conn.execute("SELECT d.*, t.tools AS tool_list FROM devices d LEFT JOIN device_tools t "
                                      "ON t.digest = d.tools_digest ORDER BY d.name").fetchall()
        devices = []
        for r in rows:
            profile = json.loads(r["profile"]) if r["profile"] else None
            if profile is not None and r["tool_list"] is not None:
                profile["tools"] = json.loads(r["tool_list"])
            devices.append(StoredDevice(name=r["name"], profile=profile, first_seen=r["first_seen"],
                                        last_seen=r["last_seen"]))
        return devices

    def device_heads(self) -> list[tuple[str, float, str | None, list[str], bool]]:
        """(name, last_seen, platform, tags, has a profile) of every known device: what start-up lists
        without reading a single profile."""
        with self._lock:
            rows = self._conn.execute("SELECT name, last_seen, platform, tags, profile IS NOT NULL "
                                      "FROM devices ORDER BY name").fetchall()
        heads = []
        for name, last_seen, platform, tags, stored in rows:
            try:
                tag_list = json.loads(tags) if tags else []
            except ValueError:
                tag_list = []
            if not isinstance(tag_list, list):
                tag_list = []
            heads.append((name, last_seen, platform if isinstance(platform, str) else None,
                          [t for t in tag_list if isinstance(t, str)], bool(stored)))
        return heads

    def device_profile(self, name: str) -> tuple[str, str | None, str | None] | None:
        """A device's stored profile as (profile JSON, tools digest, tools JSON), or None."""
        with self._lock:
            row = self._conn.execute("SELECT d.profile, d.tools_digest, t.tools FROM devices d LEFT JOIN "
                                     "device_tools t ON t.digest = d.tools_digest WHERE d.name = ?",
                                     (name,)).fetchone()
        if row is None or row[0] is None:
            return None
        return row[0], row[1] if row[2] is not None else None, row[2]

    # -- sessions --------------------------------------------------------------------------------

    def claim_session(self, session_id: str, owner: str) -> str:
        """The owner of `session_id`: `owner` when the session was free (it is theirs from now on),
        else whoever claimed it first. An owner never changes, so known ones are answered from memory."""
        known = self._session_owners.get(session_id)
        if known is not None:
            return known
        with self._writing(), self._lock:
            self._conn.execute("INSERT OR IGNORE INTO sessions (id, owner, created_at) VALUES (?, ?, ?)",
                               (session_id, owner, time.time()))
            row = self._conn.execute("SELECT owner FROM sessions WHERE id = ?", (session_id,)).fetchone()
        self._remember_owner(session_id, row[0])
        return row[0]

    def claim_sessions(self, claims: Iterable[tuple[str, str]]) -> None:
        """`claim_session` for many (session_id, owner) pairs in one transaction; taken ones stay as they are."""
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
        self._session_owners[session_id] = owner
        while len(self._session_owners) > _SESSION_CACHE:
            self._session_owners.popitem(last=False)

    # -- audit -----------------------------------------------------------------------------------

    def audit(self, requested_by: str, device: str, call_id: str | None, tool_name: str,
              arguments: dict[str, Any] | None, status: str, error: str | None,
              response_id: str | None = None, approved_by: str | None = None,
              approval_digest: str | None = None) -> None:
        self.audit_many([(requested_by, device, call_id, tool_name, arguments, status, error, response_id,
                          approved_by, approval_digest)])

    def audit_many(self, rows: Iterable[AuditRow]) -> bool:
        """Write several audit rows now, in one transaction (one per command of a batch); False when
        they could not be written, in which case they are held and retried like `audit_soon`'s.

        Arguments are stored as JSON, cut at 16 KiB so a large file write cannot bloat the log.
        """
        now = time.time()
        self._audit_pending.extend((*_full(row), now) for row in rows)
        return self.flush_audit()

    def audit_sent(self, rows: Iterable[AuditRow]) -> str | None:
        """Write a batch's rows as `sent` now, before it goes to its device; None, or why they cannot be.

        The row is the command's: it exists before anything runs, so a server killed mid-command still
        has it (see `settle_sent`). Nothing is held on failure: the caller does not send the batch.
        """
        now = time.time()
        pending = [(*_full(row), now) for row in rows]
        try:
            with self._writing():
                self._write_audit(pending)
        except StoreUnavailable as exc:
            return f"the audit log cannot be written: {exc}"
        except sqlite3.Error as exc:
            return f"the audit log cannot be written: {exc}"
        return None

    def audit_done(self, outcomes: Iterable[tuple[str, str | None, str, str | None]]) -> None:
        """Write the outcome of `sent` rows — (response_id, call_id, status, error) — before the caller
        learns it, so a delivered result is always in the log; held and retried if the disk refuses."""
        with self._lock:
            self._audit_updates.extend(outcomes)
        self.flush_audit()

    def audit_sent_grouped(self, rows: Iterable[AuditRow]) -> asyncio.Future[str | None]:
        """`audit_sent` by group commit: the `sent` rows of every batch starting in this turn of the event
        loop are inserted in one transaction; the future gives None once they are written, or why they
        could not be (then the caller does not send its batch, and nothing is held). The row still
        exists before the command goes. One INSERT commit per command was the largest single cost on
        the command path (11% of the server's CPU, bench/fleet_hotpath.py)."""
        loop = asyncio.get_running_loop()
        now = time.time()
        self._sent_pending.extend((*_full(row), now) for row in rows)
        waiter: asyncio.Future[str | None] = loop.create_future()
        self._sent_waiters.append(waiter)
        self._schedule_group(loop)
        return waiter

    def audit_done_grouped(self, outcomes: Iterable[tuple[str, str | None, str, str | None]]
                           ) -> asyncio.Future[None]:
        """`audit_done` by group commit: the outcomes of every batch that ends in the same turn of the
        event loop are written in one transaction, and each caller goes on once it is written (or held,
        as `audit_done`'s are), so the caller still learns a result only after the log has it — also
        for a reader in another process. One UPDATE commit per command cost ~5% of the server's CPU
        on the command path (bench/fleet_hotpath.py). The caller awaits the future it returns (a plain
        function: no coroutine per command)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self._audit_updates.extend(outcomes)
        waiter: asyncio.Future[None] = loop.create_future()
        self._audit_waiters.append(waiter)
        self._schedule_group(loop)
        return waiter

    def audit_done_queued(self, outcomes: Iterable[tuple[str, str | None, str, str | None]]) -> None:
        """`audit_done` for a caller that cannot wait (it is being cancelled): written with the next group
        commit when one is due — after the `sent` rows it updates — else now."""
        if self._audit_tick is None:
            self.audit_done(outcomes)
            return
        with self._lock:
            self._audit_updates.extend(outcomes)

    def _schedule_group(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._audit_tick is None:
            self._audit_tick = loop.call_soon(self._group_commit)

    def _group_commit(self) -> None:
        self._audit_tick = None
        sent, self._sent_pending = self._sent_pending, []
        sent_waiters, self._sent_waiters = self._sent_waiters, []
        waiters, self._audit_waiters = self._audit_waiters, []
        problem: str | None = None
        if self._audit_error is None and self._commit_group(sent):  # the common case: one transaction
            answered: list[asyncio.Future[Any]] = [*sent_waiters, *waiters]
            for future in answered:
                if not future.done():
                    future.set_result(None)
            return
        try:
            if sent:
                try:
                    with self._writing():
                        self._write_audit(sent)
                except (StoreUnavailable, sqlite3.Error) as exc:
                    problem = f"the audit log cannot be written: {exc}"
        finally:
            for sent_waiter in sent_waiters:
                if not sent_waiter.done():
                    sent_waiter.set_result(problem)
        try:
            self.flush_audit()  # a failure holds the rows and retries them (audit_problem says why)
        finally:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def _commit_group(self, sent: list[tuple[Any, ...]]) -> bool:
        """The group's `sent` rows, the rows `audit_soon` holds and the outcomes waiting, in ONE transaction:
        a commit (its WAL pages and locks) costs more than its rows, and the insert and the outcome
        updates touch the same pages. False, with nothing written and everything where it was, when
        it fails: `_group_commit` then writes each part on its own, with each part's own error rules."""
        with self._lock:
            pending, updates = self._audit_pending, self._audit_updates
            if not sent and not pending and not updates:
                return True
            try:
                self._conn.execute("BEGIN")
                self._insert_audit([*sent, *pending])
                self._update_outcomes(updates)
                self._conn.execute("COMMIT")
            except Exception:  # retried part by part, where each failure is reported
                self._rollback()
                return False
            self._audit_pending, self._audit_updates = [], []
        if pending and self._audit_flush is not None:
            self._audit_flush.cancel()
            self._audit_flush = None
        return True

    def settle_sent(self) -> int:
        """Rows still `sent` belong to commands the previous server never heard back from: mark them
        `unknown`; how many. Only a server that holds the database alone may call this (its start-up, under
        `tether.server.store.lease`): another live server's rows in flight are still being answered."""
        # `status = 'sent'` spelled out (not bound): the planner then reads only the index of rows in flight
        with self._writing(), self._lock:
            return self._conn.execute("UPDATE audit SET status = ?, error = ? WHERE status = 'sent'",
                                      (UNKNOWN, "outcome unknown: the server stopped before the result came back")
                                      ).rowcount

    def audit_soon(self, rows: Iterable[AuditRow]) -> None:
        """Like `audit_many`, but off the caller's path: on an event loop the rows are written within
        `_AUDIT_FLUSH_S` (one transaction for all rows waiting; a commit costs far more than a row),
        and every read of the log and `close()` write them first. Without a loop it writes at once.

        Rows that cannot be written (a full or read-only disk) are held in memory, at most
        `_AUDIT_HELD_MAX` of them, and retried every `_AUDIT_RETRY_S` and before each batch
        (`audit_problem`) until they are written; meanwhile `audit_problem` says why."""
        now = time.time()
        self._audit_pending.extend((*_full(row), now) for row in rows)
        if len(self._audit_pending) >= _AUDIT_FLUSH_ROWS and self._audit_error is None:
            self.flush_audit()
        elif self._audit_flush is None:
            self._flush_later(_AUDIT_FLUSH_S)

    def _flush_later(self, delay: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            if self._audit_error is None:  # no loop to retry from: a failing write waits for the next call
                self.flush_audit()
            return
        self._audit_flush = loop.call_later(delay, self.flush_audit)

    def flush_audit(self) -> bool:
        """Write the rows `audit_soon` is holding back; False (and they stay held) when they cannot be."""
        if self._audit_flush is not None:
            self._audit_flush.cancel()
            self._audit_flush = None
        with self._lock:
            pending, self._audit_pending = self._audit_pending, []
            updates, self._audit_updates = self._audit_updates, []
        if not pending and not updates:
            return True
        try:
            self._write_audit(pending)
            pending = []
            self._write_outcomes(updates)
        except Exception as exc:  # from a timer there is no caller to tell: hold the rows, say why, retry
            problem = disk_problem(exc, self.path) or f"cannot write the audit log {self.where}: {exc}"
            with self._lock:
                self._audit_pending[:0] = pending
                self._audit_updates[:0] = updates
                excess = len(self._audit_pending) - _AUDIT_HELD_MAX
                if excess > 0:
                    del self._audit_pending[:excess]
                    self._audit_dropped += excess
            if excess > 0:
                logger.error("audit log: %d held row(s) dropped, more than %d were waiting (%d dropped so far)",
                             excess, _AUDIT_HELD_MAX, self._audit_dropped)
            if self._audit_error is None:
                if disk_problem(exc, self.path) is None:
                    logger.exception("could not write %d audit row(s)", len(pending))
                logger.error("the audit log cannot be written, so commands are refused until it can: %s "
                             "(%d row(s) held, retried every %gs)", problem, len(self._audit_pending),
                             _AUDIT_RETRY_S)
            self._audit_error = problem
            self._flush_later(_AUDIT_RETRY_S)
            return False
        if self._audit_error is not None:
            logger.warning("the audit log can be written again: %d held row(s) written", len(pending))
            self._audit_error = None
        return True

    def audit_problem(self) -> str | None:
        """None when the audit log can take a batch's rows; else one line saying why not (the disk is
        full or read-only, held rows cannot be written). The caller refuses the batch: a command that
        cannot be audited is not run. Held rows are retried here first, so a freed disk is noticed
        by the next batch."""
        if self._memory:
            return None
        full = self._free_space_this_turn()
        if full is not None:
            return f"the audit log cannot be written: {full}"
        if self._audit_error is not None and not self.flush_audit():
            return f"the audit log cannot be written: {self._audit_error}"
        return None

    def _free_space_this_turn(self) -> str | None:
        """`free_space_problem` once per event-loop turn: every batch starting in one turn sees the same disk,
        and the REST path asks twice per batch (a statvfs each was ~3% of the server's CPU per command)."""
        if self._free_space_turn is not None:
            return self._free_space_turn[0]
        full = free_space_problem(self._directory)  # a str: `Path.parent` per call cost more than the statvfs
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return full
        self._free_space_turn = (full,)
        loop.call_soon(self._forget_free_space)
        return full

    def _forget_free_space(self) -> None:
        self._free_space_turn = None

    @property
    def audit_held(self) -> int:
        """How many audit rows (or outcomes of sent rows) wait in memory, not yet written."""
        return len(self._audit_pending) + len(self._audit_updates)

    def _insert_audit(self, rows: list[tuple[Any, ...]]) -> None:
        """INSERT the rows, inside the caller's transaction (or as one autocommit statement for one row)."""
        if not rows:
            return
        values = [(at, who, device, response_id, call_id, tool, _arguments(arguments), status, error, approved_by,
                   digest)
                  for who, device, call_id, tool, arguments, status, error, response_id, approved_by, digest, at
                  in rows]
        insert = ("INSERT INTO audit (at, requested_by, device, response_id, call_id, tool_name, arguments, "
                  "status, error, approved_by, approval_digest) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
        if len(values) == 1:
            self._conn.execute(insert, values[0])
        else:
            self._conn.executemany(insert, values)

    def _update_outcomes(self, updates: list[tuple[str, str | None, str, str | None]]) -> None:
        if updates:
            # only a row still `sent` (through the index of rows in flight): an outcome is written once
            self._conn.executemany("UPDATE audit SET status = ?, error = ? "
                                   "WHERE response_id = ? AND call_id = ? AND status = 'sent'",
                                   [(status, error, rid, cid) for rid, cid, status, error in updates])

    def _write_audit(self, rows: list[tuple[Any, ...]]) -> None:
        if not rows:
            return
        with self._lock:
            if len(rows) == 1:  # one statement is its own transaction (the common one-command batch)
                self._insert_audit(rows)
                return
            self._conn.execute("BEGIN")
            try:
                self._insert_audit(rows)
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def _write_outcomes(self, updates: list[tuple[str, str | None, str, str | None]]) -> None:
        if not updates:
            return
        with self._lock:
            self._conn.execute("BEGIN")
            try:
                self._update_outcomes(updates)
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def audit_late(self, device: str, outcomes: list[tuple[str, str, str, str | None]]) -> int:
        """Settle rows with an outcome that came back after the caller's wait ended: (response_id, call_id,
        status, error) from `device`. Only a row of that device, that batch and that call whose outcome is
        not known yet (`sent`, `pending`, `unknown`) changes — an outcome is written once, and a device
        cannot settle another's rows; its error gets `LATE_NOTE`. Written now (a late result is rare and
        must not wait for a caller that is gone); returns how many rows changed."""
        self.flush_audit()  # the `sent` rows and outcomes held back go first
        changed = 0
        with self._writing(), self._lock:
            self._conn.execute("BEGIN")
            try:
                for rid, cid, status, error in outcomes:
                    note = f"{LATE_NOTE}{': ' + error if error else ''}"
                    for unsettled in ("status = 'sent'", "status IN ('pending', 'unknown')"):  # one index each
                        cur = self._conn.execute(
                            "UPDATE audit SET status = ?, error = ? WHERE response_id = ? AND call_id = ? "  # noqa: S608
                            f"AND device = ? AND {unsettled}", (status, note, rid, cid, device))
                        changed += max(cur.rowcount, 0)
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
        return changed

    def audit_restarted(self, device: str) -> int:
        """`device` came back as a new process: its `pending` rows will get no answer (the old process and
        its commands are gone), so they become `unknown`, saying so; a late answer may still settle them."""
        self.flush_audit()
        with self._writing(), self._lock:
            cur = self._conn.execute(
                "UPDATE audit SET status = 'unknown', error = ? || coalesce(error, '') "
                "WHERE status IN ('pending', 'unknown') AND status = 'pending' AND device = ?",
                (f"outcome unknown: device {device} restarted (a new process) before the result came back; the "
                 "command was stopped with the old process, if it had started. Before: ", device))
        return max(cur.rowcount, 0)

    def audit_pending(self, outcomes: Iterable[tuple[str, str | None, str | None]]) -> None:
        """Mark `sent` rows — (response_id, call_id, error) — `pending`: the caller's wait ended while the
        command may still run; `audit_late` settles them when the outcome comes."""
        with self._lock:
            self._audit_updates.extend((rid, cid, PENDING, error) for rid, cid, error in outcomes)
        self.flush_audit()

    def batch_rows(self, response_id: str) -> list[dict[str, Any]]:
        """The audit rows of the batch `response_id`, oldest first: its record (what was asked, of which
        device, by whom, and each command's outcome so far). Looked for among the newest `_BATCH_WINDOW`
        rows (the log has no index of every row by batch: it cost each insert dearly), and among the
        rows whose outcome is still open whatever their age."""
        self.flush_audit()
        with self._lock:
            top = self._conn.execute("SELECT max(id) FROM audit").fetchone()[0] or 0
            rows = self._conn.execute(
                "SELECT * FROM audit WHERE id > ? AND response_id = ? ORDER BY id", (top - _BATCH_WINDOW, response_id)
            ).fetchall()
            if not rows:
                rows = self._conn.execute(
                    "SELECT * FROM audit WHERE response_id = ? AND status IN ('pending', 'unknown') ORDER BY id",
                    (response_id,)).fetchall()
        return [dict(r) for r in rows]

    def audit_rows(self, limit: int = 100, device: str | None = None, *, task: str | None = None,
                   token: str | None = None, since: float | None = None, until: float | None = None,
                   before: int | None = None, devices: list[str] | None = None) -> list[dict[str, Any]]:
        """The newest `limit` audit rows matching every filter given, newest first, as plain dicts.

        `token` is an API token's name: its own commands and those of the tasks and undos it started
        (`requested_by` records them as `api:NAME`, `task:ID for api:NAME`, `undo:ID by api:NAME`).
        `task` is a task id or a prefix of it; `before` is a row id, the cursor of the next page.
        `devices` (a scoped token's devices) keeps only their rows; an empty list keeps none."""
        self.flush_audit()
        where: list[str] = []
        params: list[Any] = []
        if devices is not None:
            where.append(f"device IN ({', '.join('?' * len(devices))})" if devices else "1 = 0")
            params += devices
        if device is not None:
            where.append("device = ?")
            params.append(device)
        if token is not None:
            where.append("(requested_by = ? OR requested_by LIKE ? ESCAPE '\\' OR requested_by LIKE ? ESCAPE '\\')")
            name = _like(f"api:{token}")
            params += [f"api:{token}", f"% for {name}", f"% by {name}"]
        if task is not None:
            where.append("(requested_by LIKE ? ESCAPE '\\' OR requested_by LIKE ? ESCAPE '\\')")
            prefix = _like(task[:12])
            params += [f"task:{prefix}%", f"undo:{prefix}%"]
        for column, op, value in (("at", ">=", since), ("at", "<", until), ("id", "<", before)):
            if value is not None:
                where.append(f"{column} {op} ?")
                params.append(value)
        # only constant fragments are joined; every value is a bound parameter
        query = "SELECT * FROM audit" + (" WHERE " + " AND ".join(where) if where else "")  # noqa: S608
        with self._lock:
            rows = self._conn.execute(query + " ORDER BY id DESC LIMIT ?", (*params, int(limit))).fetchall()
        return [dict(r) for r in rows]


def _like(text: str) -> str:
    """`text` with LIKE's wildcards escaped, so a name is matched as written."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _full(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """An audit row with its optional trailing `approved_by` and `approval_digest` (older callers give 8 or
    9 fields): the person who approved the command and the digest of what they were shown."""
    return row if len(row) == 10 else (*row, *(None,) * (10 - len(row)))


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


_ARGUMENTS_JSON = json.JSONEncoder(default=str, ensure_ascii=False)  # json.dumps built one per call with these


def _arguments(arguments: dict[str, Any] | None) -> str:
    if not arguments:
        return "{}"
    text = _ARGUMENTS_JSON.encode(arguments)
    if len(text) > _MAX_ARGUMENTS_CHARS:
        text = text[:_MAX_ARGUMENTS_CHARS] + f"... [truncated, {len(text)} chars]"
    return text
