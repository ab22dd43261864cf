"""Where the Store's statements run: the embedded SQLite file, or PostgreSQL for several servers as one.

The Store and the TaskStore are written against one small connection surface — `execute`,
`executemany`, `executescript`, rows read by index or column name, `in_transaction` — which is what
`sqlite3.Connection` offers. `open_connection` returns that connection for a path, and for a
`postgresql://` URL a `PostgresConnection` that offers the same surface over psycopg 3: the SQL the
stores write is the common subset of both dialects, and the few SQLite spellings they use (`?` and
`:name` placeholders, `INSERT OR IGNORE`, `json_extract`, `BEGIN IMMEDIATE`, `REAL`, `AUTOINCREMENT`)
are rewritten once per statement text. Errors come back as `sqlite3` exception classes so the stores
keep one error path, and a lost database becomes `StoreUnavailable` in one line.

Why psycopg 3 and not asyncpg (bench/db_drivers.py measures both: asyncpg's point reads are faster,
which does not decide it): the stores' interface is synchronous — every statement is short and runs on
the event loop, the design measured for SQLite — and psycopg is the driver with both a synchronous
and an asynchronous API, so the Store can move to async statement by statement on the same driver.
Statements are bounded (`statement_timeout`, `connect_timeout`) so a stalled database cannot hold the
loop longer than that.
"""

from tether.server.store.engine.core import Engine, NoLock, Ran, T
from tether.server.store.engine.disk import MIN_FREE_BYTES, disk_problem, free_space_problem
from tether.server.store.engine.names import (
    CONNECT_TIMEOUT_S,
    STATEMENT_TIMEOUT_MS,
    TOKENS_CHANNEL,
    Dialect,
    StoreUnavailable,
    describe,
    dialect_of,
    is_url,
    pick,
    safe_url,
)
from tether.server.store.engine.postgres import (
    PostgresConnection,
    Row,
    TokenListener,
    _first_line,
    open_postgres,
)
from tether.server.store.engine.schema import SCHEMA_LOCK_KEY, create_schema, schema_transaction
from tether.server.store.engine.sql import split_script, to_postgres

__all__ = [
    "CONNECT_TIMEOUT_S", "MIN_FREE_BYTES", "SCHEMA_LOCK_KEY", "STATEMENT_TIMEOUT_MS", "TOKENS_CHANNEL", "Dialect",
    "Engine", "NoLock", "PostgresConnection", "Ran", "Row", "StoreUnavailable", "T", "TokenListener", "_first_line",
    "create_schema", "describe", "dialect_of", "disk_problem", "free_space_problem", "is_url", "open_postgres",
    "pick", "safe_url", "schema_transaction", "split_script", "to_postgres",
]
