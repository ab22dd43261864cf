"""Observation points: a plan ends with `observe`, the executor runs what was planned and the planner
plans the next part from the (compacted) results. Real local device, real files, the scripted
OpenAI-compatible server; the second plan is written by a function that reads the prompt it gets,
so it only succeeds if the observation really reached the LLM."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from bench.kit.fake_llm import FakeLLM
from tests.agent.test_executor import Asker, device, make_runner, plan_of, reply, work  # noqa: F401  (fixtures)
from tether.agent.llm.chat import LLMClient
from tether.agent.planning.plan import Plan, PlanStep, validate_plan
from tether.agent.run.observe import compact
from tether.agent.run.task import Budgets, Task, TaskState
from tether.device.local import LocalDevice
from tether.tools.files.tool import files_toolset


def observed_entries(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The list_dir entries the planner was shown at the observation point."""
    text = body["messages"][-1]["content"]
    assert "Observation point" in text, text
    row = next(line for line in text.splitlines() if line.startswith('{"step": 1'))
    return json.loads(row)["result"]["entries"]


async def test_look_then_act_on_the_largest_log(device: LocalDevice, work: Path) -> None:  # noqa: F811
    logs = work / "logs"
    logs.mkdir()
    for name, size in (("a.log", 10), ("big.log", 5000), ("c.log", 300)):
        (logs / name).write_text(name[0] * size)

    def second(body: dict[str, Any]) -> str:
        largest = max(observed_entries(body), key=lambda e: e["size"])
        return reply({"steps": [{"skill": "read_file", "args": {"file_path": str(logs / largest["name"]),
                                                                "max_bytes": 64}}]})

    first = {"steps": [{"skill": "list_dir", "args": {"path": str(logs)}},
                       {"skill": "observe", "args": {"note": "which log is largest"}}]}
    async with FakeLLM([reply(first), second, "big.log is the largest."]) as fake, \
            LLMClient(fake.settings()) as llm:
        runner = await make_runner(device, llm, Asker())
        task = await runner.run(Task(request="show me the start of the largest log in logs"))
    assert task.state is TaskState.DONE, task.error
    assert task.steps[-1].command.parameters["file_path"] == str(logs / "big.log")
    assert task.steps[-1].result.result["content"].startswith("bbbb")
    # the observe step was replaced by the new part; numbering goes on
    assert task.plan is not None and [s.skill for s in task.plan.steps] == ["list_dir", "read_file"]
    assert task.counters.observe_rounds == 1 and task.counters.llm_calls == 3
    observation = fake.requests[1]["messages"][-1]["content"]
    assert "which log is largest" in observation and "numbered from 2" in observation
    sources = [e.data["source"] for e in task.events if e.kind == "plan"]
    assert sources == ["llm", "observe"]
    assert [e.data["round"] for e in task.events if e.kind == "observe"] == [1]


async def test_observe_rounds_are_budgeted(device: LocalDevice, work: Path) -> None:  # noqa: F811
    again = reply({"steps": [{"skill": "list_dir", "args": {"path": str(work)}}, {"skill": "observe"}]})
    async with FakeLLM([again, again, again]) as fake, LLMClient(fake.settings()) as llm:
        runner = await make_runner(device, llm, Asker(), budgets=Budgets(observe_rounds_per_task=1))
        task = await runner.run(Task(request="keep looking"))
    assert task.state is TaskState.FAILED
    assert "budget of 1 observation rounds" in (task.error or "") and "step 3 asked for another" in (task.error or "")
    assert len(fake.requests) == 2  # the first plan and one round; the third plan was never asked for


async def test_nothing_left_after_looking_ends_the_task(device: LocalDevice, work: Path) -> None:  # noqa: F811
    first = {"steps": [{"skill": "list_dir", "args": {"path": str(work)}}, {"skill": "observe"}]}
    async with FakeLLM([reply(first), reply({"steps": []}), "There is nothing to clean."]) as fake, \
            LLMClient(fake.settings()) as llm:
        runner = await make_runner(device, llm, Asker())
        task = await runner.run(Task(request="clean up work if it has logs"))
    assert task.state is TaskState.DONE, task.error
    assert task.answer == "There is nothing to clean." and len(task.steps) == 1


async def test_observe_in_a_hand_written_plan_needs_an_llm(device: LocalDevice, work: Path) -> None:  # noqa: F811
    plan = plan_of({"skill": "list_dir", "args": {"path": str(work)}}, {"skill": "observe"})
    runner = await make_runner(device, None, Asker())
    task = await runner.run(Task(request="look", plan=plan))
    assert task.state is TaskState.FAILED
    assert "stops to observe at step 2, which needs an LLM" in (task.error or "")
    assert len(task.steps) == 1 and task.steps[0].result.ok  # what was planned before it ran


def test_observe_only_ends_a_plan() -> None:
    tools = {None: files_toolset().infos()}
    listing = {"skill": "list_dir", "args": {"path": "/tmp"}}

    def problems(*steps: dict[str, Any]) -> list[str]:
        return validate_plan(Plan(steps=[PlanStep(**s) for s in steps]), tools)

    assert problems(listing, {"skill": "observe", "args": {"note": "x"}}) == []
    assert problems({"skill": "observe"}, listing) == [
        "step 1 (observe): observe ends a plan; it must be the last step"]
    assert "needs steps before it" in problems({"skill": "observe"})[0]
    assert "only an optional 'note'" in problems(listing, {"skill": "observe", "args": {"path": "/"}})[0]


def test_compacting_results() -> None:
    png = base64.b64encode(bytes(range(256)) * 40).decode()
    shot = compact({"data": png, "width": 800, "height": 600})
    assert shot["width"] == 800 and "binary data, 10240 bytes, not shown" in shot["data"]
    assert "get_ui_tree" in shot["data"]
    text = compact("x" * 5000)
    assert text.startswith("x" * 1500) and text.endswith("[3500 more characters of 5000]")
    items = compact(list(range(100)))
    assert items[:40] == list(range(40)) and items[40] == "[60 more items of 100]"
