"""One migration path, two dialects (issue 16): a fresh SQLite file and a fresh PostgreSQL database end with
the same tables, the same columns, the same primary and unique keys and the same indexes (names, columns,
uniqueness). Column types are not compared: they differ on purpose (REAL vs DOUBLE PRECISION, AUTOINCREMENT
vs IDENTITY). Both sides are migrated the way a server does, by opening its Store."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kits import db as dbkit

Schema = dict[str, set[tuple[str, ...]]]

# the index columns, in key order, of every index of the public schema, and whether it backs a constraint
PG_INDEXES = """
SELECT t.relname, c.relname, ix.indisunique, ix.indisprimary,
       EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conindid = ix.indexrelid) AS constraint_backed,
       array_to_string(array(SELECT a.attname FROM unnest(ix.indkey) WITH ORDINALITY AS key(attnum, n)
                             JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = key.attnum
                             ORDER BY key.n), ',')
FROM pg_index ix JOIN pg_class c ON c.oid = ix.indexrelid JOIN pg_class t ON t.oid = ix.indrelid
JOIN pg_namespace ns ON ns.oid = t.relnamespace WHERE ns.nspname = 'public'
"""


def sqlite_schema(path: Path) -> Schema:
    db = sqlite3.connect(path)
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                           "AND name NOT LIKE 'sqlite_%'")]
        schema: Schema = {"tables": {(t,) for t in tables}, "columns": set(), "keys": set(), "indexes": set()}
        for table in tables:
            info = db.execute(f'PRAGMA table_info("{table}")').fetchall()
            schema["columns"] |= {(table, row[1]) for row in info}
            pk = [row[1] for row in sorted((r for r in info if r[5]), key=lambda r: r[5])]
            if pk:
                schema["keys"].add((table, "primary", ",".join(pk)))
            for _, name, unique, origin, _partial in db.execute(f'PRAGMA index_list("{table}")').fetchall():
                columns = ",".join(r[2] for r in db.execute(f'PRAGMA index_info("{name}")').fetchall())
                if origin == "u":
                    schema["keys"].add((table, "unique", columns))
                elif origin == "c":
                    schema["indexes"].add((table, name, "unique" if unique else "plain", columns))
        return schema
    finally:
        db.close()


def postgres_schema(url: str) -> Schema:
    def rows(sql: str) -> list[list[str]]:
        return [line.split("|") for line in dbkit.psql(url, sql).splitlines() if line]

    tables = [r[0] for r in rows("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
    columns = rows("SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public'")
    schema: Schema = {"tables": {(t,) for t in tables}, "keys": set(), "indexes": set(),
                      "columns": {(r[0], r[1]) for r in columns}}
    for table, name, unique, primary, backed, columns in rows(PG_INDEXES):
        if primary == "t":
            schema["keys"].add((table, "primary", columns))
        elif backed == "t":
            schema["keys"].add((table, "unique", columns))
        else:
            schema["indexes"].add((table, name, "unique" if unique == "t" else "plain", columns))
    return schema


@pytest.fixture(scope="module")
def admin() -> Iterator[str]:
    with dbkit.postgres_session(migrated=False) as url:
        yield url


def test_the_schema_readers_agree_on_the_same_ddl(admin: str, tmp_path: Path) -> None:
    """The comparison itself can fail: the same DDL reads the same, one missing index reads different."""
    ddl = ["CREATE TABLE a (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, at REAL)",
           "CREATE TABLE b (x TEXT, y TEXT, PRIMARY KEY (x, y))",
           "CREATE INDEX a_at ON a (at, name)", "CREATE UNIQUE INDEX b_y ON b (y)"]
    dbkit.psql(admin, "CREATE DATABASE parity_check")
    url = dbkit.database_url(admin, "parity_check")
    try:
        db = sqlite3.connect(tmp_path / "x.db")
        for statement in ddl:
            db.execute(statement)
            dbkit.psql(url, statement)
        db.commit()
        db.close()
        expected = {"tables": {("a",), ("b",)},
                    "columns": {("a", "id"), ("a", "name"), ("a", "at"), ("b", "x"), ("b", "y")},
                    "keys": {("a", "primary", "id"), ("a", "unique", "name"), ("b", "primary", "x,y")},
                    "indexes": {("a", "a_at", "plain", "at,name"), ("b", "b_y", "unique", "y")}}
        assert sqlite_schema(tmp_path / "x.db") == expected
        assert postgres_schema(url) == expected
        dbkit.psql(url, "DROP INDEX b_y")
        assert postgres_schema(url) != expected
    finally:
        dbkit.psql(admin, "DROP DATABASE parity_check WITH (FORCE)")


@pytest.mark.xfail(not dbkit.store_speaks_postgres(), strict=True,
                   reason="the Store has no PostgreSQL backend yet (issue 16: tether.server.store.engine)")
def test_both_dialects_end_with_the_same_schema(admin: str, tmp_path: Path) -> None:
    dbkit.psql(admin, "CREATE DATABASE parity")
    url = dbkit.database_url(admin, "parity")
    try:
        dbkit.migrate(tmp_path / "server.db")
        dbkit.migrate(url)
        on_sqlite, on_postgres = sqlite_schema(tmp_path / "server.db"), postgres_schema(url)
        assert on_sqlite["tables"], "the migrations made no table"
        for part in ("tables", "columns", "keys", "indexes"):
            assert on_sqlite[part] == on_postgres[part], (
                part, "only SQLite:", sorted(on_sqlite[part] - on_postgres[part]),
                "only PostgreSQL:", sorted(on_postgres[part] - on_sqlite[part]))
    finally:
        dbkit.psql(admin, "DROP DATABASE parity WITH (FORCE)")
