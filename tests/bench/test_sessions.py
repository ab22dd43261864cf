"""bench/sessions.py on a tiny N: every row's commands succeed (asserted inside) and each figure is printed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `bench` lives at the repo root, beside tests/
    sys.path.insert(0, str(REPO))

from bench.sessions import SESSIONS, main  # noqa: E402


async def test_sessions_bench_runs_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    rates = await main(32)
    assert set(rates) == {"echo", *(str(k) for k in SESSIONS)}
    assert all(rate > 0 for rate in rates.values())
    out = capsys.readouterr().out
    assert "anchor: raw websockets echo" in out and "16 concurrent session(s)" in out and "of 1 session" in out
