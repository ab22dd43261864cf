"""asyncpg against psycopg 3 (async) on a private PostgreSQL: the measured reason for the driver choice.

The shape of the server's store traffic: a point read (a token by its hash), a small insert (an audit
row) and a batch of 100 inserts in one transaction, each interleaved between the two drivers and
repeated; medians and spread. Anchor: the same statement through `psql -c` is not an anchor (process
start dominates), so each driver is the other's anchor and the ratio is printed.

    python -m bench.db_drivers [--rounds 7] [--n 300]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time


async def main(rounds: int, n: int) -> None:
    import asyncpg
    import psycopg

    from bench.kit.engines import postgres_server

    with postgres_server() as pg:
        apg = await asyncpg.connect(pg.url)
        ppg = await psycopg.AsyncConnection.connect(pg.url, autocommit=True)
        await apg.execute("create table t (id bigserial primary key, k text, v text)")
        await apg.execute("insert into t (k, v) select 'k' || g, repeat('x', 200) from generate_series(1, 1000) g")
        await apg.execute("create index on t (k)")

        async def a_read() -> None:
            await apg.fetchrow("select id, v from t where k = $1", "k500")

        async def p_read() -> None:
            cur = await ppg.execute("select id, v from t where k = %s", ("k500",))
            await cur.fetchone()

        async def a_insert() -> None:
            await apg.execute("insert into t (k, v) values ($1, $2)", "a", "row")

        async def p_insert() -> None:
            await ppg.execute("insert into t (k, v) values (%s, %s)", ("p", "row"))

        async def a_batch() -> None:
            async with apg.transaction():
                await apg.executemany("insert into t (k, v) values ($1, $2)", [("b", "row")] * 100)

        async def p_batch() -> None:
            async with ppg.transaction(), ppg.cursor() as cur:
                await cur.executemany("insert into t (k, v) values (%s, %s)", [("b", "row")] * 100)

        cases = [("point read", a_read, p_read, n), ("one insert", a_insert, p_insert, n),
                 ("100 inserts, one transaction", a_batch, p_batch, max(1, n // 10))]
        for name, a, p, count in cases:
            a_meds, p_meds = [], []
            for _ in range(rounds):
                for fn, meds in ((a, a_meds), (p, p_meds)):
                    samples = []
                    for _ in range(count):
                        t0 = time.perf_counter()
                        await fn()
                        samples.append(time.perf_counter() - t0)
                    meds.append(statistics.median(samples) * 1e6)
            am, pm = statistics.median(a_meds), statistics.median(p_meds)
            print(f"{name:<30} asyncpg {am:8.1f} us ({min(a_meds):.0f}..{max(a_meds):.0f})   "
                  f"psycopg3 {pm:8.1f} us ({min(p_meds):.0f}..{max(p_meds):.0f})   psycopg/asyncpg {pm / am:5.2f}x")
        await apg.close()
        await ppg.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.n))
