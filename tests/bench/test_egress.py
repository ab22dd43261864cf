"""bench/egress.py on a tiny N: every row fetches the whole file (asserted inside) and each ratio is printed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `bench` lives at the repo root, beside tests/
    sys.path.insert(0, str(REPO))

from bench.egress import main  # noqa: E402


async def test_egress_bench_runs_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    result = await main(2, 1)
    assert all(value > 0 for value in result.values())
    out = capsys.readouterr().out
    assert "curl in the sandbox, network: {allow} (proxy)" in out and out.count("goal <= 1.2x") == 5
