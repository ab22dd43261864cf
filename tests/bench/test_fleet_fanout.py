"""bench/fleet_fanout.py at a tiny size: a real server, real devices, the fan-out and its anchor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `bench` lives at the repo root, beside tests/
    sys.path.insert(0, str(REPO))

from bench.fleet_fanout import measure  # noqa: E402


async def test_the_fan_out_row_has_its_anchor(capsys: pytest.CaptureFixture[str]) -> None:
    rows = await measure(4, repeats=1, per_process=2)
    assert [row["figure"] for row in rows] == ["fan-out to 4 devices, request -> summary p50", "  per device"]
    for row in rows:
        assert isinstance(row["measured"], float) and row["measured"] > 0, row
        assert isinstance(row["anchor"], float) and row["anchor"] > 0, row
        assert row["ratio"] == row["measured"] / row["anchor"], row
    assert "4 REST POSTs" in capsys.readouterr().out
