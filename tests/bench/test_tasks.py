"""bench/tasks.py's measurements on a tiny N: every task ends done on its script, with the counts it must have."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `bench` lives at the repo root, beside tests/
    sys.path.insert(0, str(REPO))

from bench.tasks import SCENARIOS, measure_overhead, measure_tasks, print_overhead, print_tasks  # noqa: E402


async def test_llm_usage_per_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows, tools = await measure_tasks(tmp_path)
    assert tools >= 10 and len(rows) == len(SCENARIOS) == 5
    by_name = {row.name: row for row in rows}
    expected = {  # tether's calls by kind, the loop's calls, and commands sent (tether, loop)
        "happy path, 3 steps": ({"plan": 1, "answer": 1}, 4, (3, 3)),
        "2 missing parents, fast path": ({"plan": 1, "answer": 1}, 6, (5, 5)),
        "wrong name, LLM AUTO_PATCH x2": ({"plan": 1, "recovery": 2, "answer": 1}, 4, (4, 3)),
        "missing file, LLM REPLAN": ({"plan": 2, "recovery": 1, "answer": 1}, 5, (4, 4)),
        "8-step plan": ({"plan": 1, "answer": 1}, 9, (8, 8)),
    }
    for name, (tether_kinds, loop_calls, commands) in expected.items():
        row = by_name[name]
        assert row.tether.kind_calls == tether_kinds, name
        assert row.tether.calls == sum(tether_kinds.values()), name
        assert row.loop.calls == loop_calls and row.loop.kind_calls == {"action": loop_calls}, name
        assert (row.tether.commands, row.loop.commands) == commands, name
        # every call carries tokens, and the loop resends its prompt and history on every call
        assert row.tether.prompt_tokens > 100 * row.tether.calls, name
        assert row.loop.prompt_tokens > row.tether.prompt_tokens, name
    assert by_name["2 missing parents, fast path"].tether.failures == 2  # both fixed without the LLM
    print_tasks(rows, tools)
    out = capsys.readouterr().out
    assert "all 5 tasks" in out and "8-step plan" in out


async def test_time_per_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    k = 5
    overhead = await measure_overhead(tmp_path, 3 * k, k)
    assert len(overhead.direct) == 3 * k
    assert len(overhead.runner) == len(overhead.stored) == 3 * (k - 1)
    assert len(overhead.runner_task) == len(overhead.stored_task) == 3
    assert all(s > 0 for s in [*overhead.direct, *overhead.runner, *overhead.stored])
    assert (tmp_path / "state" / "tasks.db").exists()
    print_overhead(overhead, k)
    assert "tether adds p50" in capsys.readouterr().out


async def test_tasks_that_need_a_look(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.look_tasks import LOOK_SCENARIOS, measure_look_tasks, print_look_tasks

    rows = await measure_look_tasks(tmp_path)
    assert len(rows) == len(LOOK_SCENARIOS) == 3
    for row in rows:  # both succeed: the files each task must leave are there
        assert row.tether_ok and row.loop_ok, row.name
        # plan, one observe round, and an answer call only where the reply depends on what the last part reads
        answer = {"answer": 1} if row.name == "the report changed today" else {}
        assert row.tether.kind_calls == {"plan": 2, **answer}, row.name
        assert row.loop.kind_calls == {"action": row.loop.calls}, row.name
    by_name = {row.name: row for row in rows}
    assert by_name["back up ~/notes to the nas"].loop.calls == 8  # list, 3 x (read, write), done
    assert by_name["back up ~/notes to the nas"].tether.commands == 7  # list, 3 reads, 3 writes by $ref
    print_look_tasks(rows)
    out = capsys.readouterr().out
    assert "success: tether 3/3, loop 3/3" in out
