"""bench/cluster.py at its smallest: every row has its anchor measured in the same run (issue 16)."""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `bench` lives at the repo root, beside tests/
    sys.path.insert(0, str(REPO))

from bench import cluster  # noqa: E402


def check(rows: list[dict[str, object]], figures: list[str]) -> None:
    assert [row["figure"] for row in rows] == figures
    for row in rows:
        assert isinstance(row["measured"], float) and row["measured"] > 0 and not math.isnan(row["measured"]), row
        assert isinstance(row["anchor"], float) and row["anchor"] > 0, row
        assert row["ratio"] == row["measured"] / row["anchor"] and row["goal"], row


async def test_redis_cost_rows_measure_the_nodes_own_leases() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with cluster.redis_server(Path(tmp)) as port:
            rows = await cluster.redis_costs(port, 200, repeats=2)
    check(rows, ["Redis memory per device lease", "one heartbeat's renewal of 200 leases"])
    assert "4 Redis commands" in str(rows[1]["note"])


async def test_the_whole_bench_at_its_smallest_measures_fail_over_against_its_budget() -> None:
    rows = await cluster.measure(quick=True)
    clustered = cluster.has_cluster_option()
    figures = [str(row["figure"]) for row in rows]
    assert figures[:2] == ["Redis memory per device lease", "one heartbeat's renewal of 1000 leases"]
    if clustered:  # the node rows of a tether whose server takes --cluster
        assert figures[2].startswith("command round trip, another node holds the device")
        assert figures[3] == "commands/s, 6 devices on 3 clustered nodes" and "0 failed" in str(rows[3]["note"])
    assert figures[-2].startswith("kill -9 a node") and "devices registered elsewhere" in figures[-2]
    assert figures[-1].endswith("its 5 waiting tasks owned by another node"), figures
    assert len(rows) == (6 if clustered else 4)
    check(rows, figures)
    assert rows[-1]["anchor"] == rows[-2]["anchor"] == cluster.HEARTBEAT["timeout"] + cluster.HEARTBEAT["grace"]
