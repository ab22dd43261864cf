"""bench/capture_stall.py on a tiny N: the big command's files all land, both rows are measured and printed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `bench` lives at the repo root, beside tests/
    sys.path.insert(0, str(REPO))

from bench.capture_stall import main  # noqa: E402


async def test_capture_stall_bench_runs(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", os.environ.get("HOME", "/"))  # the bench points HOME elsewhere: put it back after
    figures = await main(200, 1)
    assert figures["anchor_p99_ms"] > 0 and figures["load_p99_ms"] > 0
    out = capsys.readouterr().out
    assert "true, no load (anchor)" in out and "true, during 200 files" in out and "201 changes" in out
