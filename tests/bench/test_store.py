"""bench/store.py at its smallest: the Store on SQLite and on a real PostgreSQL, every row with its anchor."""

from __future__ import annotations

import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `bench` lives at the repo root, beside tests/
    sys.path.insert(0, str(REPO))

from bench import store  # noqa: E402


def test_every_operation_is_measured_on_both_backends() -> None:
    rows = store.report(store.measure(3, rounds=1))
    assert [r["figure"] for r in rows] == ["verify_token, cached",
                                           "verify_token, a query", "upsert_device", "100 audit rows, one commit",
                                           "audit_rows, a page of 100", "point read, psycopg sync vs asyncpg"]
    for row in rows:
        assert row["measured"] > 0 and row["anchor"] > 0 and not math.isnan(row["ratio"]), row
