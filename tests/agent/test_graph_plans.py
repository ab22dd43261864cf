"""Graph plans in one process: the plan check's reasons, live edits (refused for a cycle, applied whole), and
an `observe` that re-plans its branch while a sibling runs, with the scripted OpenAI-compatible server and a
real local device (built-in tools, real files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.kit.fake_llm import FakeLLM
from tests.agent.test_executor import Asker, device, make_runner, reply, work  # noqa: F401  (fixtures)
from tether.agent.llm.chat import LLMClient
from tether.agent.planning.edits import EditRefused, GraphEdit, apply_edit
from tether.agent.planning.plan import PLAN_JSON_SCHEMA, PlanError, plan_from_data, validate_plan
from tether.agent.planning.schema import plan_schema
from tether.agent.run.task import Task, TaskEvent, TaskState
from tether.device.local import LocalDevice
from tether.protocol.models import ToolInfo

ECHO = ToolInfo(name="echo", namespace="t", tool_type="action", description="",
                input_schema={"type": "object", "properties": {"text": {"type": "string"}}},
                output_schema={"type": "object", "properties": {"text": {"type": "string"}},
                               "additionalProperties": False})
TOOLS: dict[str | None, list[ToolInfo]] = {None: [ECHO], "b": [ECHO]}


def echo(ident: str, needs: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": ident, "skill": "echo", "args": {"text": ident}, **({"needs": needs} if needs is not None else {}),
            **extra}


def test_the_plan_check_names_cycles_unknown_needs_and_refs_off_the_branch() -> None:
    cycle = plan_from_data([echo("a", []), echo("b", ["c"]), echo("c", ["b"])])
    assert validate_plan(cycle, TOOLS) == ["the steps need each other in a cycle: b → c → b (each needs the one "
                                           "before it); a plan's steps must be able to run in some order"]
    unknown = plan_from_data([echo("a", []), echo("b", ["nope"])])
    assert "step 2 (b): needs 'nope', which is no step of the plan" in validate_plan(unknown, TOOLS)[0]
    sideways = plan_from_data([echo("a", []), {**echo("b", []), "args": {"text": {"$ref": "steps.a.result.text"}}},
                               {**echo("c", ["a"]), "args": {"text": {"$ref": "steps.a.result.nokey"}}}])
    problems = validate_plan(sideways, TOOLS)
    assert problems[0].startswith("step 2 (b): bad reference at text: 'steps.a.result.text' names step 1, which "
                                  "this step does not need")
    assert "has no key 'nokey'" in problems[1] and len(problems) == 2
    condition = plan_from_data([echo("a", []), echo("b", [], when={"ref": "steps.a.result.text", "equals": "a"})])
    assert "when: 'steps.a.result.text' reads step 1, which this step does not need" in validate_plan(condition,
                                                                                                      TOOLS)[0]
    with pytest.raises(PlanError, match="exactly one of equals, contains, matches"):
        plan_from_data([echo("a", [], when={"ref": "steps.a.result", "equals": 1, "contains": "x"})])
    chain = plan_from_data([echo("a"), {**echo("b"), "args": {"text": {"$ref": "steps.a.result.text"}}}])
    assert validate_plan(chain, TOOLS) == []  # a list is a chain: each step needs the one before it


def test_an_edit_is_applied_whole_or_refused_with_the_reason() -> None:
    plan = plan_from_data([echo("a", []), echo("b", ["a"]), echo("c", ["b"])])
    states = ["done", "pending", "pending"]
    with pytest.raises(EditRefused) as refused:
        apply_edit(plan, states, GraphEdit(add_needs={"b": ["c"]}), TOOLS)
    assert "cycle" in str(refused.value) and plan.steps[1].needs == ["a"]  # nothing changed
    with pytest.raises(EditRefused, match="step 1 has already done"):
        apply_edit(plan, states, GraphEdit(remove=["a"]), TOOLS)
    new, new_states = apply_edit(plan, states, GraphEdit(remove=["c"], add=plan_from_data([echo("d", ["b"])]).steps),
                                 TOOLS)
    assert new_states == ["done", "pending", "removed", "pending"] and new.steps[3].id == "d"


def test_the_planner_schema_offers_graphs_without_a_top_level_any_of() -> None:
    schema, _ = plan_schema({"local": type("V", (), {"tools": [ECHO], "profile": None})()})  # type: ignore[dict-item]
    item = schema["properties"]["steps"]["items"]["anyOf"][0]
    assert {"id", "needs", "when"} <= set(item["properties"]) and set(item["required"]) == set(item["properties"])
    for top in (schema, PLAN_JSON_SCHEMA):
        assert not {"anyOf", "oneOf", "allOf"} & set(top)


async def test_observe_re_plans_its_branch_and_a_cyclic_edit_is_refused(device: LocalDevice,  # noqa: F811
                                                                          work: Path) -> None:  # noqa: F811
    (work / "logs").mkdir()
    (work / "logs" / "big.log").write_text("b" * 50)
    sibling = work / "sibling.txt"

    def write(ident: str, path: Path, needs: list[str]) -> dict[str, Any]:
        return {"id": ident, "skill": "write_file", "args": {"file_path": str(path), "content": ident}, "needs": needs}

    first = {"steps": [{"id": "look", "skill": "list_dir", "args": {"path": str(work / "logs")}, "needs": []},
                       {"id": "o", "skill": "observe", "args": {"note": "which log"}, "needs": ["look"]},
                       write("side", sibling, []),
                       write("fin", work / "fin.txt", ["o", "side"])]}
    cyclic = {"steps": [write("c1", work / "c1.txt", ["c2"]), write("c2", work / "c2.txt", ["c1"])]}
    fixed = {"steps": [write("c1", work / "c1.txt", [])]}
    events: list[TaskEvent] = []
    async with FakeLLM([reply(first), reply(cyclic), reply(fixed), "all written"]) as fake, \
            LLMClient(fake.settings()) as llm:
        runner = await make_runner(device, llm, Asker(), events)
        task = await runner.run(Task(request="look at the logs, then write notes"))
    assert task.state is TaskState.DONE, task.error
    refused = [e.data for e in events if e.kind == "edit_refused"]
    assert len(refused) == 1 and "cycle" in refused[0]["reasons"][0] and refused[0]["step"] == 1
    applied = [e.data for e in events if e.kind == "edit"]
    assert len(applied) == 1 and applied[0]["source"] == "observe" and applied[0]["rewire"] == {"2": ["c1"]}
    assert "problems" in fake.requests[2]["messages"][-1]["content"]  # the re-ask named the cycle
    assert "Observation point" in json.dumps(fake.requests[1]["messages"])
    assert task.plan is not None and [s.id for s in task.plan.steps] == ["look", "o", "side", "fin", "c1"]
    assert task.step_states == ["done", "done", "done", "done", "done"]
    assert task.plan.steps[3].needs == ["3", "c1"]  # fin waits for the new part instead of the observation
    assert (work / "c1.txt").read_text() == "c1" and sibling.read_text() == "side"
    order = [e.data["step"] for e in events if e.kind == "step_finished"]
    assert order.index(4) > order.index(2) and order[-1] == 3


def test_the_gateway_s_run_task_takes_graphs_under_a_schema_without_top_level_combinators() -> None:
    from tether.agent.tasks.api.mcp_tools import _run_input

    schema = _run_input()
    assert not {"anyOf", "oneOf", "allOf"} & set(schema)
    step = schema["$defs"]["PlanStep"]["properties"]
    assert {"id", "needs", "when", "requires"} <= set(step)


def test_tether_log_draws_a_graph_in_80_columns() -> None:
    from tether.agent.planning.plan import Plan
    from tether.agent.run.graph.view import draw, graph_of

    plan = plan_from_data([echo("gather_from_a_very_long_name", [], device="b"), echo("b", []),
                           echo("sum", ["gather_from_a_very_long_name", "b"],
                                when={"ref": "steps.b.result.text", "matches": "x" * 150})])
    task = Task(request="r", plan=Plan(steps=plan.steps), step_states=["done", "running", "pending"])
    lines = draw(task)
    assert all(len(line) <= 80 for line in lines) and lines[0] == "graph: 3 steps, up to 2 at once"
    assert lines[2].startswith(" 0 ├─[+]  1 gather_from_a_very_long_name echo @b") and "[>]  2 b" in lines[3]
    assert lines[4].startswith(" 1 └─[ ]  3 sum") and lines[4].endswith("…")
    assert graph_of(Task(request="r", plan=Plan(steps=plan_from_data([echo("a")]).steps))) is None


async def test_a_failing_branch_is_re_planned_while_its_sibling_goes_on(device: LocalDevice,  # noqa: F811
                                                                        work: Path) -> None:  # noqa: F811
    (work / "real.txt").write_text("the real one")
    plan = {"steps": [{"id": "read", "skill": "read_file", "args": {"file_path": str(work / "missing.txt")},
                       "needs": []},
                      {"id": "side", "skill": "write_file", "device": "other", "needs": [],
                       "args": {"file_path": str(work / "side.txt"), "content": "side"}},
                      {"id": "save", "skill": "write_file", "needs": ["read", "side"],
                       "args": {"file_path": str(work / "copy.txt"),
                                "content": {"$ref": "steps.read.result.content"}}}]}
    decision = {"decision": "REPLAN", "suggestion": "read real.txt instead"}
    part = {"steps": [{"id": "read", "skill": "read_file", "args": {"file_path": str(work / "real.txt")},
                       "needs": None}]}
    events: list[TaskEvent] = []
    async with FakeLLM([reply(plan), reply(decision), reply(part), "copied"]) as fake, \
            LLMClient(fake.settings()) as llm:
        runner = await make_runner(device, llm, Asker(), events)
        runner.tools["other"] = runner.tools[None]
        task = await runner.run(Task(request="copy the file"))
    assert task.state is TaskState.DONE, task.error
    assert task.step_states == ["replaced", "done", "done", "done"]  # save read the new step by the old id
    assert task.plan is not None and task.plan.steps[2].needs == ["2", "read"] and task.plan.steps[3].id == "read"
    assert (work / "copy.txt").read_text() == "the real one" and (work / "side.txt").read_text() == "side"
    [edit] = [e.data for e in events if e.kind == "edit"]
    assert edit["source"] == "replan" and edit["replace"] == "1" and edit["rewire"] == {"1": ["read"]}
    assert "The plan is a graph" in fake.requests[2]["messages"][-1]["content"]


def test_undo_visits_the_device_changed_last_first() -> None:
    from datetime import UTC, datetime, timedelta

    from tether.agent.planning.plan import PlanStep
    from tether.agent.run.task import StepRecord
    from tether.protocol.models import Command, Result

    base = datetime(2026, 1, 1, tzinfo=UTC)

    def ran(on: str | None, second: int) -> StepRecord:
        return StepRecord(index=0, step=PlanStep(skill="x", device=on), command=Command(tool_name="x"),
                          result=Result.failure("x"), finished_at=base + timedelta(seconds=second))

    task = Task(request="r", device="home", steps=[ran("a", 1), ran(None, 4), ran("b", 3), ran("a", 2)])
    assert task.devices_used() == ["a", "home", "b"]  # first use, in record order
    assert task.devices_undo_order() == ["home", "b", "a"]  # the last change first


async def test_a_branch_s_new_steps_wait_for_confirmation_when_the_task_says_so(device: LocalDevice,  # noqa: F811
                                                                                 work: Path) -> None:  # noqa: F811
    first = {"steps": [{"id": "look", "skill": "list_dir", "args": {"path": str(work)}, "needs": []},
                       {"id": "o", "skill": "observe", "args": {"note": "what is there"}, "needs": ["look"]}]}
    part = {"steps": [{"id": "note", "skill": "write_file", "needs": None,
                       "args": {"file_path": str(work / "note.txt"), "content": "seen"}}]}
    asker = Asker("run", "cancel")
    async with FakeLLM([reply(first), reply(part)]) as fake, LLMClient(fake.settings()) as llm:
        runner = await make_runner(device, llm, asker)
        task = await runner.run(Task(request="look, then note", confirm="always"))
    assert task.state is TaskState.CANCELLED and task.error == "the new steps were not confirmed"
    assert [q.kind for q in task.questions] == ["confirmation", "confirmation"]
    assert "Run these new steps (they replace step 2 (o))" in task.questions[1].question
    assert not (work / "note.txt").exists()  # nothing unconfirmed ran
