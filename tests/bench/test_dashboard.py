"""bench/dashboard.py on a tiny fleet: every state change reaches the fleet stream and the page loads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `bench` lives at the repo root, beside tests/
    sys.path.insert(0, str(REPO))

from bench.dashboard import main  # noqa: E402


async def test_dashboard_bench_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert await main(20, 6) == 0
    out = capsys.readouterr().out
    assert "20 devices connected" in out and "fleet stream's first frame: 20 rows" in out
    assert "ratio of medians" in out and "seen in the dashboard" in out and "first load: dashboard" in out
