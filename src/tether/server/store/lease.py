"""One server per state: the lease a `tether server` takes on its database before it touches a row.

Two things are leased, both for the life of the process and released by the operating system or the
database when the process dies (kill -9 included), so there is never a stale lock to clean up:

- **the node**: one server per (database, node id). The node id defaults to the host name and a digest
  of the state directory and database (`ServerSettings.node`), so a second `tether server` started by
  mistake on the same state — on the same port or another — is refused, and so is a second cluster node
  given an id already in use. SQLite: an exclusive `flock` on `<db>.node-<digest>.lock` beside the
  database, which also holds the holder's pid and address for the refusal. PostgreSQL: a session
  advisory lock (`pg_try_advisory_lock`) on a hash of the node id, held on a connection of its own,
  whose `application_name` names the holder.
- **the database, shared**: every server holds a shared lock on the database (`<db>.lock`, or a shared
  advisory lock). A server that finds it can take it *exclusively* is the only one on that database:
  only then may it settle what a previous server left in flight (audit rows left `sent`), since no
  live server can still hear those commands' results. It keeps the exclusive lock until it has
  settled them (`settled()`), then holds it shared like every other server.

`StateBusy` is the refusal: one line that says who holds the lease, raised before anything was written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from tether.server.store.engine import CONNECT_TIMEOUT_S, StoreUnavailable, disk_problem, is_url, safe_url

# How long a PostgreSQL lease waits for a holder to go: a server killed a moment ago holds its lock until
# its backend notices the closed connection (milliseconds on one host; the keepalives below bound it
# elsewhere). A live holder is still there after the wait, and the starter is refused.
PG_LEASE_WAIT_S = 3.0
PG_SHARED_WAIT_S = 30.0  # a server taking the database shared waits for one that is settling alone
# the lease connection's keepalives (both ends): a holder whose host died loses its lease within ~30 s
_KEEPALIVE: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}
_PG_KEEPALIVE_OPTIONS = "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3"


class StateBusy(StoreUnavailable):
    """Another live server holds this state (the node id on this database): nothing was touched."""


def advisory_key(name: str) -> int:
    """A PostgreSQL advisory lock key (signed 64 bits) for a name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


DATABASE_KEY = advisory_key("tether:server")  # held shared by every server, exclusively by one alone


def node_digest(node: str) -> str:
    return hashlib.sha256(node.encode()).hexdigest()[:16]


class StateLease:
    """What `take_lease` holds; `release()` (or the process's end) gives it back."""

    def __init__(self, where: str, node: str, alone: bool, holder: Any) -> None:
        self.where = where
        self.node = node
        self.alone = alone  # no other server on this database: what the last one left in flight is ours to settle
        self._holder = holder

    def announce(self, host: str, port: int) -> None:
        """Say where this server listens, for the refusal a second one prints."""
        self._holder.announce({"pid": os.getpid(), "host": host, "port": port, "node": self.node})

    def settled(self) -> None:
        """Start-up recovery is done: hold the database shared, so other servers may join it."""
        if self.alone:
            self._holder.share()

    def lost(self) -> bool:
        """Whether the lease was lost since it was taken (PostgreSQL: its session ended, say the database
        restarted). Reads what the connection already received, never waits: safe on the event loop."""
        return self._holder.lost()

    def retake(self) -> str | None:
        """Take a lost lease again (blocking, up to the connect timeout: run it off the event loop); None once
        held, else why not (another server took the node meanwhile, the database is still away)."""
        return self._holder.retake()

    def release(self) -> None:
        self._holder.close()


def take_lease(target: str | Path, node: str, *, host: str = "", port: int = 0,
               default_node: bool = True) -> StateLease:
    """Lease `node` on the database `target` (a SQLite path or a `postgresql://` URL); `StateBusy` when a
    live server holds it. `default_node`: the id was derived, not given (it words the refusal)."""
    info = {"pid": os.getpid(), "host": host, "port": port, "node": node}
    if is_url(target):
        holder: Any = _PostgresHolder(str(target), node, info, default_node)
        where = safe_url(str(target))
    else:
        path = Path(target).expanduser()
        holder = _FileHolder(path, node, info, default_node)
        where = str(path)
    return StateLease(where, node, holder.alone, holder)


def _refusal(where: str, node: str, holder: dict[str, Any] | None, default_node: bool) -> str:
    who = "another tether server"
    if holder and holder.get("pid"):
        address = f"{holder.get('host') or '?'}:{holder['port']}" if holder.get("port") else "?"
        machine = f" on {holder['client']}" if holder.get("client") else ""
        who += f" (pid {holder['pid']}{machine}, listening on {address})"
    if default_node:
        return (f"{who} already serves this state ({where}, node {node}); stop it first, or start this one "
                "as another node (--node-id NAME, or a state directory of its own)")
    return (f"node id {node} is already taken by {who} on {where}; give each node its own --node-id")


# -- SQLite: lock files beside the database --------------------------------------------------------------


def _open_lock_file(path: Path) -> int:
    """A descriptor of the lock file (created 0600; read-only when the directory cannot be written, since
    flock needs no write access), or `StoreUnavailable` in one line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        with contextlib.suppress(OSError):
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        raise StoreUnavailable(disk_problem(exc, path) or f"cannot create the lock file {path}: {exc}") from None


class _FileHolder:
    def __init__(self, db: Path, node: str, info: dict[str, Any], default_node: bool) -> None:
        self.node_path = db.with_name(f"{db.name}.node-{node_digest(node)}.lock")
        self.database_path = db.with_name(f"{db.name}.lock")
        self._node_fd = _open_lock_file(self.node_path)
        try:
            fcntl.flock(self._node_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._node_fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreUnavailable(f"cannot lock {self.node_path}: {exc}") from None
            raise StateBusy(_refusal(str(db), node, self._read_holder(), default_node)) from None
        self._database_fd = -1
        try:
            self._database_fd = _open_lock_file(self.database_path)
            try:
                fcntl.flock(self._database_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.alone = True
            except BlockingIOError:
                self.alone = False
                fcntl.flock(self._database_fd, fcntl.LOCK_SH)  # waits only for a server settling alone
        except BaseException:
            self.close()
            raise
        self.announce(info)

    def _read_holder(self) -> dict[str, Any] | None:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.node_path.read_text() or "null")
            return data if isinstance(data, dict) else None
        return None

    def announce(self, info: dict[str, Any]) -> None:
        """The holder's pid and address in the node's lock file (best effort: a full disk keeps the lock)."""
        data = json.dumps(info).encode()
        with contextlib.suppress(OSError):
            os.ftruncate(self._node_fd, 0)
            os.pwrite(self._node_fd, data, 0)

    def share(self) -> None:
        fcntl.flock(self._database_fd, fcntl.LOCK_SH)

    def lost(self) -> bool:
        return False  # a flock lasts as long as the descriptor

    def retake(self) -> str | None:
        return None

    def close(self) -> None:
        for fd in (self._database_fd, self._node_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)  # closing the only descriptor releases its flock
        self._database_fd = self._node_fd = -1


# -- PostgreSQL: advisory locks on a connection of their own ----------------------------------------------


class _PostgresHolder:
    def __init__(self, url: str, node: str, info: dict[str, Any], default_node: bool) -> None:
        try:
            import psycopg
        except ImportError:
            raise StoreUnavailable("a postgresql:// database needs psycopg: pip install 'tether[cluster]'") from None
        self._psycopg = psycopg
        self.url = url
        self.node = node
        self.info = info
        self.node_key = advisory_key(f"tether:node:{node}")
        try:
            self._conn = psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                                         application_name=_application_name(info), options=_PG_KEEPALIVE_OPTIONS,
                                         **_KEEPALIVE)
        except psycopg.Error as exc:
            raise StoreUnavailable(f"cannot reach the database {safe_url(url)}: {_first_line(exc)}") from None
        try:
            if not self._lock(f"pg_advisory_lock({self.node_key})", PG_LEASE_WAIT_S):
                raise StateBusy(_refusal(safe_url(url), node, self._holder_of(self.node_key), default_node))
            alone = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (DATABASE_KEY,)).fetchone()
            self.alone = bool(_scalar(alone))
            if not self.alone and not self._lock(f"pg_advisory_lock_shared({DATABASE_KEY})", PG_SHARED_WAIT_S):
                raise StoreUnavailable(f"the database {safe_url(url)} is held alone by another server starting up; "
                                       "try again")
        except psycopg.Error as exc:
            self.close()
            raise StoreUnavailable(f"cannot lease the database {safe_url(url)}: {_first_line(exc)}") from None
        except BaseException:
            self.close()
            raise

    def _lock(self, call: str, wait_s: float) -> bool:
        """Wait up to `wait_s` for a lock (`lock_timeout`, no polling); False when it was not granted."""
        try:
            self._conn.execute(f"SET lock_timeout = {int(wait_s * 1000)}")
            self._conn.execute(f"SELECT {call}")
            return True
        except self._psycopg.errors.LockNotAvailable:
            return False
        finally:
            with contextlib.suppress(self._psycopg.Error):
                self._conn.execute("RESET lock_timeout")

    def _holder_of(self, key: int) -> dict[str, Any] | None:
        with contextlib.suppress(self._psycopg.Error):
            row = self._conn.execute(
                "SELECT a.application_name, host(a.client_addr) FROM pg_locks l "
                "JOIN pg_stat_activity a ON a.pid = l.pid "
                "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
                "AND l.classid::bigint = %s AND l.objid::bigint = %s LIMIT 1",
                ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF)).fetchone()
            if row is not None:
                found = _APPLICATION_NAME.fullmatch(row[0] or "")
                if found is None:
                    return {"pid": f"? ({row[0]})", "client": row[1]}
                port = int(found["port"]) if found["port"].isdigit() else 0
                return {"pid": int(found["pid"]), "host": found["host"], "port": port,
                        "client": None if row[1] in (None, "127.0.0.1", "::1") else row[1]}
        return None

    def announce(self, info: dict[str, Any]) -> None:
        self.info = info
        with contextlib.suppress(self._psycopg.Error):
            self._conn.execute(f"SET application_name = '{_application_name(info)}'")

    def lost(self) -> bool:
        from psycopg.pq import ConnStatus

        pg = self._conn.pgconn
        if self._conn.closed or pg.status != ConnStatus.OK:
            return True
        try:
            pg.consume_input()  # what the server sent meanwhile: a "terminating connection" or the EOF of its end
        except self._psycopg.Error:
            return True
        return pg.status != ConnStatus.OK

    def retake(self) -> str | None:
        psycopg = self._psycopg
        with contextlib.suppress(Exception):
            self._conn.close()
        try:
            self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                                         application_name=_application_name(self.info),
                                         options=_PG_KEEPALIVE_OPTIONS, **_KEEPALIVE)
            if not _scalar(self._conn.execute("SELECT pg_try_advisory_lock(%s)", (self.node_key,)).fetchone()):
                holder = self._holder_of(self.node_key)
                self._conn.close()
                return _refusal(safe_url(self.url), self.node, holder, False)
            self._conn.execute("SELECT pg_advisory_lock_shared(%s)", (DATABASE_KEY,))
        except psycopg.Error as exc:
            with contextlib.suppress(Exception):
                self._conn.close()
            return f"cannot reach the database {safe_url(self.url)}: {_first_line(exc)}"
        return None

    def share(self) -> None:
        self._conn.execute("SELECT pg_advisory_lock_shared(%s)", (DATABASE_KEY,))
        self._conn.execute("SELECT pg_advisory_unlock(%s)", (DATABASE_KEY,))
        self.alone = False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.close()  # the session ends: its advisory locks go with it


_APPLICATION_NAME = re.compile(r"tether server pid=(?P<pid>\d+) (?P<host>[^ ]*):(?P<port>\d+|\?) node=.*")


def _application_name(info: dict[str, Any]) -> str:
    """`tether server pid=… port=… node=…`, quote-free (it is spelled into a SET) and within 63 bytes."""
    text = f"tether server pid={info['pid']} {info.get('host') or ''}:{info.get('port') or '?'} node={info['node']}"
    return "".join(c for c in text if c.isprintable() and c not in "'\\")[:63]


def _scalar(row: tuple[Any, ...] | None) -> Any:
    """The one value of a query that always returns one row (a SELECT of a function call)."""
    if row is None:
        raise StoreUnavailable("the database answered a SELECT of a function with no row")
    return row[0]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
