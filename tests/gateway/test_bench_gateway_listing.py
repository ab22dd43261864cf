"""bench/gateway_listing.py at a tiny size: both listings and the search measured, the table printed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
if str(REPO) not in sys.path:  # `bench` lives at the repo root, beside tests/
    sys.path.insert(0, str(REPO))

from bench.gateway_listing import TOOLS, main  # noqa: E402


async def test_the_listing_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    rows = await main(20, 1)
    assert [tools for _, _, tools in rows["full"]] == [20 * len(TOOLS) + 2]  # list_devices, run_on_fleet
    assert [tools for _, _, tools in rows["progressive"]] == [3]
    assert rows["full"][0][1] > 10 * rows["progressive"][0][1]
    assert rows["find_tools"][0][2] == 20
    assert "x full bytes" in capsys.readouterr().out
