"""One audit group commit with PostgreSQL 2 ms away: four statements in a transaction against one pipeline.

    python -m bench.db_group [--rows N] [--rounds R] [--delay-ms D]

A private PostgreSQL (bench/kit/engines.py) behind a TCP proxy that delays every byte D ms each way
(bench/kit/delay_proxy.py). Each sample writes one group of N `sent` rows and the outcomes of N earlier rows
to the `audit` table of a real `Store`, through its own engine connection:

- anchor: `BEGIN`, the INSERTs (executemany), the UPDATEs (executemany), `COMMIT` — four round trips;
- measured: `PostgresConnection.execute_together` (what `AuditTable._write_together` runs with PostgreSQL):
  the same statements in one psycopg pipeline, one implicit transaction — one round trip.

The two alternate sample by sample, R rounds of 20 samples each; printed: the median ms per group of each
round (median of the rounds and their spread), in round trips of 2 x D, and the ratio measured / anchor.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from itertools import count
from typing import Any

from bench._stats import spread
from bench.kit.delay_proxy import DelayProxy
from bench.kit.engines import postgres_server

_INSERT = ("INSERT INTO audit (at, requested_by, device, response_id, call_id, tool_name, arguments, status, error, "
           "approved_by, approval_digest) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
_SETTLE = "UPDATE audit SET status = ?, error = ? WHERE response_id = ? AND call_id = ? AND status = 'sent'"
SAMPLES = 20


def main(rows: int, rounds: int, delay_ms: float) -> int:
    from tether.server.store import Store

    with tempfile.TemporaryDirectory(prefix="tether-db-group-"), postgres_server() as pg, \
            contextlib.closing(DelayProxy(pg.port, delay_ms / 1000).start()) as proxy:
        store = Store(f"postgresql://tether@127.0.0.1:{proxy.port}/postgres")
        conn = store._engine.audit_conn  # the audit log's own session, as the worker uses it
        numbers = count()

        def group() -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
            batch = next(numbers)
            sent = [(time.time(), "api:bench", "alpha", f"r{batch}", f"c{i}", "noop", "{}", "sent", None, None, None)
                    for i in range(rows)]
            done = [("success", None, f"r{batch - 1}", f"c{i}") for i in range(rows)]  # the last group's rows
            return sent, done

        def four() -> None:
            sent, done = group()
            conn.execute("BEGIN")
            conn.executemany(_INSERT, sent)
            conn.executemany(_SETTLE, done)
            conn.execute("COMMIT")

        def one() -> None:
            sent, done = group()
            conn.execute_together([(_INSERT, sent), (_SETTLE, done)])

        ways: dict[str, Callable[[], None]] = {"BEGIN, INSERT, UPDATE, COMMIT": four, "one pipeline": one}
        medians: dict[str, list[float]] = {name: [] for name in ways}
        for fn in ways.values():  # warm-up: connections, plans
            fn()
        for _ in range(rounds):
            samples: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(SAMPLES):
                for name, fn in ways.items():
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t0)
            for name in ways:
                medians[name].append(statistics.median(samples[name]) * 1e3)
        store.close()
    trip = 2 * delay_ms
    print(f"one audit group of {rows} rows + {rows} outcomes, PostgreSQL {delay_ms:g} ms away each way "
          f"(round trip {trip:g} ms); {rounds} rounds x {SAMPLES} samples, alternating")
    anchor = statistics.median(medians["BEGIN, INSERT, UPDATE, COMMIT"])
    for name, values in medians.items():
        value = statistics.median(values)
        print(f"{name:<34} {value:7.2f} ms  spread {spread(values):>13}  {value / trip:5.2f} round trips  "
              f"x anchor {value / anchor:.2f}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    args = parser.parse_args()
    raise SystemExit(main(args.rows, args.rounds, args.delay_ms))
