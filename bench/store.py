"""The server's Store on its embedded SQLite file against the same Store on PostgreSQL (issue 16).

    python -m bench.store [N]

Rows, each operation timed N times per round on both backends, rounds interleaved, medians and spread
(the SQLite Store is the anchor of each PostgreSQL row):
- verify_token (`store.tokens.verify`), a token seen before (the cache, checked against changes made by other
  servers);
- verify_token, a secret that is no token (never cached: a query each time);
- upsert_device (`store.devices.upsert`: a device registering, one row and its tool list);
- 100 audit rows written as one group commit (`store.audit.record_soon` + `store.audit.flush`);
- audit_rows (`store.audit.rows`), a page of 100.
And the driver's own cost: one point read through psycopg 3's synchronous connection (what the Store
runs on the loop) against asyncpg's (the fastest async driver), same database, same statement.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench._stats import spread
from tether.server.store import Store

ROUNDS = 5
PROFILE = json.dumps({"os": {"platform": "linux"}, "tags": ["lab"], "name": "bench"})


def operations(store: Store, n: int) -> dict[str, Callable[[], None]]:
    hot = store.tokens.create("api", "bench", ["read"])[1]
    store.tokens.verify(hot)
    devices = iter(range(10**9))

    def audit_100() -> None:
        store.audit.record_soon(("api:bench", "laptop", f"c{i}", "shell.run", {"argv": ["ls"]}, "success", None, "r",
                                 None) for i in range(100))
        store.audit.flush()

    return {
        "verify_token, cached": lambda: store.tokens.verify(hot),
        "verify_token, a query": lambda: store.tokens.verify("tapi_not-a-token"),  # unknown: never cached
        "upsert_device": lambda: store.devices.upsert(f"d{next(devices)}", PROFILE, time.time(), tools=("dg", "[]")),
        "100 audit rows, one commit": audit_100,
        "audit_rows, a page of 100": lambda: store.audit.rows(100),
    }


def timed(op: Callable[[], None], n: int) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        op()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


async def driver_reads(url: str, n: int, rounds: int) -> dict[str, list[float]]:
    import asyncpg
    import psycopg

    sync = psycopg.connect(url, autocommit=True)
    apg = await asyncpg.connect(url)
    out: dict[str, list[float]] = {"psycopg sync": [], "asyncpg": []}
    try:
        for _ in range(rounds):
            out["psycopg sync"].append(timed(
                lambda: sync.execute("SELECT id, name FROM tokens WHERE hash = %s", ("x",)).fetchone(), n))
            samples = []
            for _ in range(n):
                t0 = time.perf_counter()
                await apg.fetchrow("SELECT id, name FROM tokens WHERE hash = $1", "x")
                samples.append(time.perf_counter() - t0)
            out["asyncpg"].append(statistics.median(samples))
    finally:
        sync.close()
        await apg.close()
    return out


def measure(n: int, rounds: int = ROUNDS) -> dict[str, Any]:
    from bench.kit.engines import postgres_server  # starts a private PostgreSQL

    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp, postgres_server() as pg:
        stores = {"SQLite": Store(Path(tmp) / "server.db"), "PostgreSQL": Store(pg.url)}
        try:
            ops = {name: operations(store, n) for name, store in stores.items()}
            medians: dict[str, dict[str, list[float]]] = {name: {op: [] for op in ops[name]} for name in stores}
            for _ in range(rounds):
                for op in ops["SQLite"]:
                    for name in stores:  # interleaved: each operation on both backends, in every round
                        medians[name][op].append(timed(ops[name][op], n))
            drivers = asyncio.run(driver_reads(pg.url, n, rounds))
        finally:
            for store in stores.values():
                store.close()
    return {"stores": medians, "drivers": drivers, "n": n, "rounds": rounds}


def report(measured: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    print(f"{measured['rounds']} interleaved rounds of {measured['n']} per operation; medians of round medians")
    sqlite, pg = measured["stores"]["SQLite"], measured["stores"]["PostgreSQL"]
    for op in sqlite:
        a, b = statistics.median(sqlite[op]) * 1e6, statistics.median(pg[op]) * 1e6
        rows.append({"figure": op, "measured": b, "anchor": a, "ratio": b / a})
        print(f"{op:<28} PostgreSQL {b:8.1f} us ({spread([x * 1e6 for x in pg[op]])})   "
              f"SQLite (anchor) {a:8.1f} us ({spread([x * 1e6 for x in sqlite[op]])})   {b / a:5.2f}x")
    sync, apg = (statistics.median(measured["drivers"][k]) * 1e6 for k in ("psycopg sync", "asyncpg"))
    rows.append({"figure": "point read, psycopg sync vs asyncpg", "measured": sync, "anchor": apg,
                 "ratio": sync / apg})
    print(f"{'point read, driver only':<28} psycopg sync {sync:8.1f} us   asyncpg (anchor) {apg:8.1f} us   "
          f"{sync / apg:5.2f}x")
    return rows


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    report(measure(int(args[0]) if args else 300))


if __name__ == "__main__":
    main()
