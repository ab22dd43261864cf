"""The schema of the server's database and how it grows: `MIGRATIONS`, applied in order by `migrate`.

The schema is versioned (`schema_version`) and grows by appending to `MIGRATIONS`, so later issues add
tables without touching existing rows.
"""

from __future__ import annotations

from tether.server.store.engine import Engine, pick, schema_transaction, split_script

# One migration path for both databases: a text both read (the engine rewrites SQLite's few spellings for
# PostgreSQL: REAL, AUTOINCREMENT, `?`), or {"sqlite": …, "postgres": …} where they must differ.
MIGRATIONS: list[str | dict[str, str]] = [
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
    # who owns each undo session a command may journal into (see tether.server.trust.sessions)
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
    # pairing requests of devices that enrol without a token (see tether.server.trust.pairing)
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
    # which plans of the tasks an API token creates wait for a person's confirmation (tether.agent.run.confirm)
    """
    ALTER TABLE tokens ADD COLUMN confirm TEXT NOT NULL DEFAULT 'never';
    """,
    # known devices read at start-up without their profiles: a device's tool list is kept once
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
    # a command's outcome finds its `sent` row through an index of the rows still in flight: the
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
    # which devices an API token reaches (docs/security/scopes.md): device names or globs and
    # device tags, JSON lists; both empty = every device, as before
    """
    ALTER TABLE tokens ADD COLUMN scope_devices TEXT NOT NULL DEFAULT '[]';
    ALTER TABLE tokens ADD COLUMN scope_tags TEXT NOT NULL DEFAULT '[]';
    """,
    # whose a token is: a person's (agent = 0, what every token made before is) or an agent's (1),
    # which never approves; and the digest of what the person who approved a command was shown
    """
    ALTER TABLE tokens ADD COLUMN agent INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE audit ADD COLUMN approval_digest TEXT;
    """,
    # a device is its key: each device's Ed25519 public key, proved at every registration
    # (tether.server.trust.device_keys); a pairing request carries the key that asks
    """
    CREATE TABLE device_keys (
        name TEXT PRIMARY KEY,
        public_key TEXT NOT NULL,
        enrolled_at REAL NOT NULL,
        enrolled_by TEXT NOT NULL
    );
    ALTER TABLE pairing ADD COLUMN public_key TEXT;
    """,
    # outcomes that come late (docs/outcomes.md): a row whose caller's wait ended while the command
    # may still run is `pending` (or `unknown` after a restart) until the device's result settles it; this
    # index holds only those rows, as `audit_inflight` holds the `sent` ones, so it stays small
    """
    CREATE INDEX audit_unsettled ON audit (response_id, call_id) WHERE status IN ('pending', 'unknown');
    """,
    # tags an admin set on a device (issue 32, docs/fleet.md): a JSON list that stands for the tags the device
    # reports, at every registration; NULL = the device's own
    """
    ALTER TABLE devices ADD COLUMN admin_tags TEXT;
    """,
    # webhooks (docs/approvals.md): where notifications go (a token's, or the server's when owner is NULL) and
    # each delivery with its attempts, so that retries survive a restart
    """
    CREATE TABLE webhooks (
        id TEXT PRIMARY KEY,
        url TEXT NOT NULL,
        secret TEXT NOT NULL,
        events TEXT NOT NULL,
        format TEXT NOT NULL,
        owner TEXT,
        source TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE TABLE webhook_deliveries (
        id TEXT PRIMARY KEY,
        webhook_id TEXT NOT NULL,
        event TEXT NOT NULL,
        body TEXT NOT NULL,
        status TEXT NOT NULL,
        attempts INTEGER NOT NULL,
        next_at REAL NOT NULL,
        last_status INTEGER,
        last_error TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_at) WHERE status = 'pending';
    CREATE INDEX webhook_deliveries_of ON webhook_deliveries (webhook_id, created_at);
    """,
]


def migrate(engine: Engine) -> None:
    """Bring the schema to this tether's version in one transaction under the schema lock
    (`schema_transaction`): servers starting at once on a fresh database migrate it once, one after
    the other, and the later ones find it current. The caller holds `engine.lock`. RuntimeError when
    the database's schema is newer than this tether's; `sqlite3.Error` (or `StoreUnavailable`) when a
    statement fails, with nothing changed."""
    conn = engine.conn
    # a current schema is read without the lock (a reader of a read-only state directory opens it too)
    if engine.dialect == "sqlite":
        exists = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'schema_version'").fetchone()
    else:
        exists = conn.execute("SELECT to_regclass('schema_version')").fetchone()[0]
    if exists and _version(engine) == len(MIGRATIONS):
        return
    with schema_transaction(conn):
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        current = _version(engine)
        if current > len(MIGRATIONS):
            raise RuntimeError(f"{engine.where} has schema version {current}, newer than this tether "
                               f"({len(MIGRATIONS)}); upgrade tether or use another --db")
        for version in range(current + 1, len(MIGRATIONS) + 1):
            for statement in split_script(pick(MIGRATIONS[version - 1], engine.dialect)):
                conn.execute(statement)
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))


def _version(engine: Engine) -> int:
    row = engine.conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def schema_version(engine: Engine) -> int:
    """The database's schema version: how many of `MIGRATIONS` it has."""
    with engine.lock:
        return engine.conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]
