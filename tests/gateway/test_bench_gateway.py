"""bench/gateway.py at a tiny size: every row measured, the report printed with its ratio to the anchor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
if str(REPO) not in sys.path:  # `bench` lives at the repo root, beside tests/
    sys.path.insert(0, str(REPO))

from bench.gateway import PAIR, ROWS, measure, report  # noqa: E402


async def test_the_gateway_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    measured = await measure(6, rounds=2)
    assert set(measured["rows"]) == set(ROWS)
    assert all(len(samples) == 6 for samples in measured["rows"].values())
    assert all(s > 0 for name, samples in measured["rows"].items() if name != PAIR for s in samples)
    figures = report(measured)
    assert figures["ratio"] == figures["added"] / figures["bare SDK"]
    assert figures["json_ratio"] == figures["added"] / figures["bare SDK JSON"]
    assert figures["rest_ratio"] == figures["gateway 2026"] / figures["REST"]
    out = capsys.readouterr().out
    assert "the bare SDK server's round trip" in out and "goal <= 1.2x" in out and "SDK's JSON mode" in out
    assert "stateless 2026-07-28 / the same call over REST" in out
