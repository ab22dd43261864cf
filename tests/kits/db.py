"""Where a test's server keeps its state: the SQLite file it always had, or (TETHER_TEST_DB=postgres) a fresh
database of a private PostgreSQL started once per pytest session (issue 16: "the whole existing server suite
also passes against PostgreSQL").

Every testkit that starts a real server asks this module, never decides itself:
- `server_db(path)`: what to give the server (`--db`, settings, Store) for the state a test would keep at
  `path`; in PostgreSQL mode each distinct `path` of a test is its own database, created on first use from a
  template that already has the migrations, so a test that restarts a server on the same path finds its state
  and two servers of one test stay apart, exactly as with two files;
- `server_db_args(path)`: the `--db …` argv for a `tether server` process;
- `create_tokens(target, specs)`: tokens written into that state before a server process starts.

The per-test databases are dropped when the test ends (conftest's `_test_database` fixture). The
session's engine and the current test's name prefix travel in environment variables the fixture sets with
monkeypatch, so a testkit needs no fixture argument and a child process inherits nothing it would use.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import importlib.util
import inspect
import os
import subprocess
import sys
import uuid
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, TypeVar

from bench.kit.engines import _postgres_bin, postgres_server

MODE_ENV = "TETHER_TEST_DB"
ADMIN_ENV = "TETHER_TEST_PG_ADMIN"  # the session engine's maintenance URL (database "postgres")
PREFIX_ENV = "TETHER_TEST_PG_PREFIX"  # the current test's database name prefix
USED_ENV = "TETHER_TEST_PG_USED"  # the databases the current test created, space-separated: teardown drops them
TEMPLATE = "tether_template"
PSQL_TIMEOUT_S = 60.0

Backend = Literal["sqlite", "postgres"]
T = TypeVar("T")


def backend() -> Backend:
    """The database the server suite runs against; a misspelt value is an error, not a silent SQLite run."""
    value = os.environ.get(MODE_ENV, "sqlite").strip().lower() or "sqlite"
    if value not in ("sqlite", "postgres"):
        raise RuntimeError(f"{MODE_ENV}={value!r}: expected 'sqlite' or 'postgres'")
    return value  # type: ignore[return-value]


def store_speaks_postgres() -> bool:
    """True once the server's Store has its engine layer (issue 16, S1) and so opens a `postgresql://`
    URL where it opened a path; until then PostgreSQL mode refuses."""
    try:
        if importlib.util.find_spec("tether.server.store.engine") is None:
            return False
    except ModuleNotFoundError:  # tether.server.store is still a module, not a package
        return False
    from tether.server.store import engine

    # the engine layer opens postgresql:// URLs (the Store itself may be synchronous or async)
    return hasattr(engine, "open_postgres") or hasattr(engine, "open_engine")


def psql(admin_url: str, sql: str) -> str:
    """One statement through psql (argv, no shell): the admin work is a handful of DDL statements per test."""
    done = subprocess.run([_postgres_bin("psql"), admin_url, "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
                           "-c", sql], capture_output=True, text=True, timeout=PSQL_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"psql failed: {sql!r}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def database_url(admin_url: str, name: str) -> str:
    return admin_url.rsplit("/", 1)[0] + "/" + name


def migrate(target: Path | str) -> None:
    """Apply the server's migrations to `target` (a path or a URL) the way a server does: by opening its
    Store, synchronous as it is today or async (`await Store.open`) as the storage contract has it."""
    from tether.server.store import Store

    if not hasattr(Store, "open"):  # the Store as it is: synchronous, over psycopg for PostgreSQL
        Store(str(target)).close()
        return

    async def opened() -> None:
        store = await Store.open(str(target))  # type: ignore[attr-defined]
        await store.aclose()

    _run(opened())


@contextlib.contextmanager
def postgres_session(*, migrated: bool = True) -> Iterator[str]:
    """A private PostgreSQL for the session and the template every test database is copied from (with the
    server's migrations applied once when `migrated`); yields the engine's maintenance URL."""
    if migrated and not store_speaks_postgres():
        raise RuntimeError(f"{MODE_ENV}=postgres: this tether's Store has no PostgreSQL backend yet "
                           "(tether.server.store.engine, issue 16)")
    with postgres_server() as engine:
        admin = engine.url
        psql(admin, f"CREATE DATABASE {TEMPLATE}")
        if migrated:
            # the migrations once; every test's database is then a file copy (CREATE DATABASE … TEMPLATE)
            migrate(database_url(admin, TEMPLATE))
        yield admin


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from synchronous testkit code, also when called inside a test's loop
    (a sync helper called from an async test): then on a helper thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@contextlib.contextmanager
def fresh_postgres_database(prefix: str) -> Iterator[str]:
    """A new database copied from the migrated template, dropped afterwards; yields its URL. On the session's
    PostgreSQL (TETHER_TEST_DB=postgres) or one started here; without either the test fails, never skips."""
    import psycopg  # noqa: F401  (the test extra installs it: a missing driver fails, never skips)
    import pytest

    with contextlib.ExitStack() as stack:
        if backend() != "postgres":
            try:
                admin = stack.enter_context(postgres_session())
            except (RuntimeError, FileNotFoundError) as exc:
                pytest.fail(f"no PostgreSQL to run against (scripts/test installs it): {exc}", pytrace=False)
        else:
            admin = os.environ[ADMIN_ENV]
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        psql(admin, f'CREATE DATABASE "{name}" TEMPLATE {TEMPLATE}')
        stack.callback(psql, admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        yield database_url(admin, name)


@contextlib.contextmanager
def per_test_databases(admin_url: str, prefix: str = "t") -> Iterator[str]:
    """The scope of a test's (or, with prefix "s", the session's) databases: those created inside it are
    dropped when it ends. Nested: a module- or session-scoped fixture's server, set up before any test's
    scope opens, gets a database of the session's scope and keeps it for all the tests that share it.
    Yields the name prefix."""
    prefix = f"{prefix}_{uuid.uuid4().hex[:16]}"
    saved = {key: os.environ.get(key) for key in (ADMIN_ENV, PREFIX_ENV)}
    os.environ.update({ADMIN_ENV: admin_url, PREFIX_ENV: prefix})
    try:
        yield prefix
    finally:
        created = os.environ.get(USED_ENV, "").split()
        mine = [name for name in created if name.startswith(prefix + "_")]
        os.environ[USED_ENV] = " ".join(name for name in created if name not in mine)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for name in mine:
            # FORCE: a server a failed test left running must not keep its database alive
            psql(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def server_db(path: Path | str) -> Path | str:
    """The state a server keeps at `path`: that path with SQLite, a database URL of its own with PostgreSQL."""
    if backend() == "sqlite":
        return Path(path)
    admin, prefix = os.environ.get(ADMIN_ENV), os.environ.get(PREFIX_ENV)
    if not admin or not prefix:
        raise RuntimeError(f"{MODE_ENV}=postgres outside a test session: conftest's _postgres_admin fixture "
                           "sets up the session's PostgreSQL")
    digest = hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:10]
    created = os.environ.get(USED_ENV, "").split()
    # the same path in any open scope is the same database: a test restarting a module fixture's server
    known = [name for name in created if name.endswith("_" + digest)]
    if known:
        return database_url(admin, known[0])
    name = f"{prefix}_{digest}"
    # FILE_COPY: a small template copies faster than through the WAL (32 vs 40 ms here)
    psql(admin, f'CREATE DATABASE "{name}" TEMPLATE {TEMPLATE} STRATEGY FILE_COPY')
    os.environ[USED_ENV] = " ".join([*created, name])
    return database_url(admin, name)


def settings_db(path: Path | str) -> dict[str, Any]:
    """ServerSettings values for an in-process server keeping its state at `path`: `db_path`, and with
    PostgreSQL the `db_url` of its database (the server then opens `settings.db_url or settings.db_path`)."""
    target = server_db(path)
    return {"db_path": Path(path)} if isinstance(target, Path) else {"db_path": Path(path), "db_url": target}


def server_db_args(path: Path | str) -> list[str]:
    """`--db …` for a `tether server` process keeping its state at `path` (or in its PostgreSQL database)."""
    return ["--db", str(server_db(path))]


def create_tokens(target: Path | str, specs: Sequence[tuple[str, str, Sequence[str]]]) -> list[str]:
    """Create (kind, name, scopes) tokens in the state at `target` before a server process starts; the secrets.

    Synchronous for the testkits that build a server process's state before starting it; works with the
    Store as it is (synchronous, SQLite) and as issue 16 makes it (`await Store.open(target)`, async methods).
    """
    from tether.server.store import Store

    if hasattr(Store, "open"):  # the async Store of the storage contract (as `migrate` asks)
        async def create() -> list[str]:
            store = await Store.open(str(target))  # type: ignore[attr-defined]
            try:
                return [(await store.tokens.create(kind, name, list(scopes)))[1] for kind, name, scopes in specs]
            finally:
                await store.aclose()

        return _run(create())
    store = Store(str(target))
    try:
        return [store.tokens.create(kind, name, list(scopes))[1] for kind, name, scopes in specs]
    finally:
        store.close()



MARK = "__keeps_server_state__"
K = TypeVar("K")


def keeps_server_state(obj: K) -> K:
    """Mark a testkit's entry point (a class or function that starts a server whose state goes through
    this module): a test reaching one is in the PostgreSQL pass."""
    setattr(obj, MARK, True)
    return obj


def _marked(value: object) -> bool:
    try:
        return getattr(value, MARK, False) is True
    except Exception:  # an object whose attribute access raises (a lazy proxy) is not a testkit
        return False


_SELF = sys.modules[__name__]


def starts_servers(item: Any) -> bool:
    """A collected test that starts a server through a testkit: its module, or a module defining one of its
    fixtures, holds a `keeps_server_state` entry point or this module itself. This is the PostgreSQL pass's
    selection, so it cannot rot into a hand list: a new test using any testkit is in it."""
    module = getattr(item, "module", None)
    namespaces = [vars(module)] if isinstance(module, ModuleType) else []
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    for defs in (fixtureinfo.name2fixturedefs.values() if fixtureinfo else ()):
        # the defining module through the function's globals: every conftest.py is module "conftest",
        # so sys.modules by name would give another directory's conftest
        namespaces.extend(getattr(inspect.unwrap(d.func), "__globals__", {}) for d in defs)
    # a test module importing this module keeps a server's state through it by hand
    return any(_marked(value) or value is _SELF for namespace in namespaces for value in namespace.values())
