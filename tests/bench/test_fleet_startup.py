"""bench/fleet_startup.py at its smallest: every row is measured against its anchor in the same run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `bench` lives at the repo root, beside tests/
    sys.path.insert(0, str(REPO))

from bench.fleet_startup import measure  # noqa: E402


def test_every_start_up_row_has_its_anchor(capsys: pytest.CaptureFixture[str]) -> None:
    rows = measure(1)
    assert [row["figure"] for row in rows] == ["tether --help", "tether exec get_system_info (local)",
                                               "tether server start -> /health (empty db)",
                                               "tether device launch -> registered",
                                               "  the same, one external stdio MCP server"]
    for row in rows:
        assert isinstance(row["measured"], float) and row["measured"] > 0, row
        assert isinstance(row["anchor"], float) and row["anchor"] > 0, row
        assert row["ratio"] == row["measured"] / row["anchor"] and row["unit"] == "s" and row["goal"], row
    out = capsys.readouterr().out
    assert out.count("goal <=") == 5 and "python websockets + 1 echo" in out and "bare uvicorn+FastAPI" in out
