"""bench/fleet_hotpath.py, bench/fleet_storm.py and bench/fleet.py at their smallest: every row has its anchor
measured in the same run, and fleet.py gathers the fleet_*.py modules' rows into one table."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `bench` lives at the repo root, beside tests/
    sys.path.insert(0, str(REPO))

from bench import fleet, fleet_hotpath, fleet_storm  # noqa: E402


def check(rows: list[dict[str, object]], figures: list[str]) -> None:
    assert [row["figure"] for row in rows] == figures
    for row in rows:
        assert isinstance(row["measured"], float) and row["measured"] > 0 and not math.isnan(row["measured"]), row
        assert isinstance(row["anchor"], float) and row["anchor"] > 0, row
        assert row["ratio"] == row["measured"] / row["anchor"] and row["goal"], row


def test_hot_path_rows_have_their_anchors(capsys: pytest.CaptureFixture[str]) -> None:
    rows = fleet_hotpath.measure(quick=True)
    check(rows, ["REST commands/s, closed loop", "REST commands/s vs a bare uvicorn+Starlette route",
                 "server CPU per REST command"])
    assert "websockets echo" in capsys.readouterr().out


def test_storm_brings_every_device_back_and_health_answered_throughout() -> None:
    rows = fleet_storm.measure(devices=20, per_process=10)
    check(rows, ["restart under 20 devices: /health answers", "restart under 20 devices: all registered again",
                 "/health p99 during the storm", "a registered device's command p99 during the storm"])
    assert "0 unanswered" in str(rows[2]["note"]) and "0 failed (0 while idle)" in str(rows[3]["note"])


def test_fleet_runs_every_fleet_module_and_prints_one_table(capsys: pytest.CaptureFixture[str]) -> None:
    names = fleet.modules()
    assert {"hotpath", "storm"} <= set(names)
    rows, failed = fleet.run(None, quick=True, only=["hotpath", "storm"])
    assert failed == 0
    text = fleet.table(rows)
    assert len(text.splitlines()) == 1 + len(rows) and "server CPU per REST command" in text
    assert "all registered again" in text


def test_fleet_reports_a_measure_it_cannot_call() -> None:
    def needs(colour: str) -> list[dict[str, object]]:
        return []

    with pytest.raises(TypeError, match="colour"):
        fleet.call_measure(needs, None, True)
    seen: dict[str, object] = {}

    def takes(devices: int = 1, repeats: int = 3, quick: bool = False) -> list[dict[str, object]]:
        seen.update(devices=devices, repeats=repeats, quick=quick)
        return []

    fleet.call_measure(takes, 7, True)
    assert seen == {"devices": 7, "repeats": 1, "quick": True}


def test_fleet_runs_an_async_measure_and_sizes_one_without_a_default() -> None:
    seen: dict[str, object] = {}

    async def sized(devices: int, repeats: int = 5) -> list[dict[str, object]]:
        seen.update(devices=devices, repeats=repeats)
        return [{"figure": "x"}]

    assert fleet.call_measure(sized, None, True) == [{"figure": "x"}]
    assert seen == {"devices": 50, "repeats": 1}
