"""What keeping the cluster's view converged costs (issue 28, item 5; server/cluster/view.py).

    python -m bench.cluster_view [--devices N] [--nodes K] [--rounds R]

A private redis-server (bench/kit/engines.py) holding N device leases spread over K nodes, each node's
stored set and digest written by the nodes' own `HeldSets`. Rows, rounds interleaved, medians and spread:
1. a quiet beat of one node: renewing its own set (unchanged), the digest of its view of all N devices,
   and one MGET of the other nodes' digests — what every node pays every heartbeat;
2. re-reading one node's set after it changed (SMEMBERS of its N/K devices, the directory asked about
   the one device in dispute) — what a change costs each other node, once;
3. re-reading a node that holds all N devices and disagrees on every one (SMEMBERS + MGET of N keys) —
   the worst case, e.g. after a Redis restart;
anchor: the whole directory read as a resubscription does it (SCAN of the device keys + MGET of N),
which is what checking the view every beat would cost without the digests.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from bench._stats import spread
from bench.kit.engines import redis_server


async def _time(work: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await work()
    return time.perf_counter() - start


async def run(devices: int, nodes: int, rounds: int) -> None:
    import redis.asyncio as aioredis

    from tether.server.cluster.directory import Directory
    from tether.server.cluster.view import HeldSets, digest

    with redis_server() as engine:
        client = aioredis.from_url(engine.url, socket_timeout=30)
        names = [f"dev-{i:05d}" for i in range(devices)]
        owner = {name: f"n{i % nodes}" for i, name in enumerate(names)}
        async with client.pipeline(transaction=False) as pipe:
            for name, node in owner.items():
                pipe.set(Directory.device_key(name), node, px=600_000)
            await pipe.execute()
        sets = {f"n{k}": HeldSets(client, f"n{k}", 600_000) for k in range(nodes)}
        for node, held in sets.items():
            await held.store({n for n, o in owner.items() if o == node})
        big = HeldSets(client, "all", 600_000)
        await big.store(set(names))
        me, mine = sets["n0"], {n for n, o in owner.items() if o == "n0"}
        others = [n for n in sets if n != "n0"]

        async def quiet_beat() -> None:
            await me.store(mine)
            shown: dict[str, set[str]] = {}
            for name, node in owner.items():  # the registry walk of ClusterNode._reconcile
                if node != "n0":
                    shown.setdefault(node, set()).add(name)
            differ = await me.differing({n: digest(v) for n, v in shown.items()}, others)
            assert differ == [], differ

        async def one_changed() -> None:
            shown = {n for n, o in owner.items() if o == "n1"} - {names[1]}
            disputed = await me.members("n1") ^ shown
            assert len(await me.owners(disputed)) == 1

        async def worst() -> None:
            assert len(await me.owners(await me.members("all"))) == devices

        async def full_scan() -> None:
            keys = [k async for k in client.scan_iter(match=Directory.device_key("*"), count=1000)]
            for at in range(0, len(keys), 1000):
                await client.mget(keys[at:at + 1000])

        rows: dict[str, list[float]] = {"quiet beat": [], "one node changed": [], "worst re-read": [],
                                        "anchor: full directory read": []}
        for _ in range(rounds):  # interleaved: each round runs every figure once, in turn
            for label, work in zip(rows, (quiet_beat, one_changed, worst, full_scan), strict=True):
                samples = [await _time(work) for _ in range(5)]
                rows[label].append(statistics.median(samples))
        await client.aclose()
    anchor = statistics.median(rows["anchor: full directory read"])
    print(f"{devices} devices over {nodes} nodes, {rounds} rounds (median of 5 each), real redis-server")
    for label, medians in rows.items():
        value = statistics.median(medians)
        print(f"{label:30} {value * 1e3:8.2f} ms  (spread {spread([m * 1e3 for m in medians])} ms)  "
              f"{value / anchor:5.2f}x the anchor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(run(args.devices, args.nodes, args.rounds))


if __name__ == "__main__":
    main()
