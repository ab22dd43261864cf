"""References between steps ({"$ref": "steps.N.result..."}): checked with the plan, resolved at run time,
and a reference that does not resolve is a failed step that recovery handles. Real local device, real
files, the scripted OpenAI-compatible server for the LLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.kit.fake_llm import FakeLLM
from tests.agent.test_executor import Asker, device, make_runner, plan_of, reply, work  # noqa: F401  (fixtures)
from tether.agent.llm.chat import LLMClient
from tether.agent.planning.plan import Plan, PlanStep, validate_plan
from tether.agent.planning.planner import build_messages
from tether.agent.planning.refs import RefError, parse_ref, resolve
from tether.agent.run.executor import TaskRunner
from tether.agent.run.task import Task, TaskState
from tether.device.local import LocalDevice
from tether.protocol.models import ToolInfo
from tether.tools.files.tool import files_toolset


def ref(text: str) -> dict[str, str]:
    return {"$ref": text}


def backup_steps(notes: Path, nas: Path) -> list[dict]:
    return [{"skill": "read_file", "args": {"file_path": str(notes / "todo.txt")}, "description": "read the notes"},
            {"skill": "write_file", "args": {"file_path": str(nas / "todo.txt"),
                                             "content": ref("steps.1.result.content")},
             "description": "copy them to the nas"}]


async def test_backup_to_the_nas_copies_the_real_content(device: LocalDevice, work: Path) -> None:  # noqa: F811
    notes, nas = work / "notes", work / "nas"
    notes.mkdir()
    nas.mkdir()
    (notes / "todo.txt").write_text("buy milk\nfix the roof\n")
    plan = {"steps": backup_steps(notes, nas)}
    async with FakeLLM([reply(plan), "Backed up."]) as fake, LLMClient(fake.settings()) as llm:
        runner = await make_runner(device, llm, Asker())
        task = await runner.run(Task(request="back up ~/notes/todo.txt to the nas"))
    assert task.state is TaskState.DONE, task.error
    assert (nas / "todo.txt").read_text() == "buy milk\nfix the roof\n"  # not the literal reference
    # the plan keeps the reference; the command sent carries the value
    assert task.plan is not None and task.plan.steps[1].args["content"] == ref("steps.1.result.content")
    assert task.steps[1].command.parameters["content"] == "buy milk\nfix the roof\n"
    # the planner was taught the syntax
    system = fake.requests[0]["messages"][0]["content"]
    assert '"$ref": "steps.N.result.KEY"' in system and "observe" in system


async def test_hand_written_plan_with_reference_into_a_list(device: LocalDevice, work: Path) -> None:  # noqa: F811
    (work / "a-first.log").write_text("first log")
    (work / "b-second.log").write_text("second")
    plan = plan_of({"skill": "list_dir", "args": {"path": str(work)}},
                   {"skill": "shell.run", "args": {"cmd": "cat", "argv": [ref("steps.1.result.entries[0].name")],
                                                   "cwd": str(work)}})
    runner = await make_runner(device, None, Asker())
    task = await runner.run(Task(request="read the first file", plan=plan))
    assert task.state is TaskState.DONE, task.error
    assert task.steps[1].command.parameters["argv"] == ["a-first.log"]
    assert task.steps[1].result.result["stdout"] == "first log"


def test_plan_check_names_bad_references() -> None:
    files = files_toolset().infos()
    typed = ToolInfo(name="count", namespace="x", tool_type="data_collection",
                     input_schema={"type": "object", "properties": {}},
                     output_schema={"type": "object", "properties": {"total": {"type": "integer"},
                                                                     "items": {"type": "array",
                                                                               "items": {"type": "string"}}},
                                    "required": ["total"]})
    tools: dict[str | None, list[ToolInfo]] = {None: [*files, typed]}
    read = {"skill": "read_file", "args": {"file_path": "/tmp/x"}}

    def problems(*steps: dict) -> list[str]:
        return validate_plan(Plan(steps=[PlanStep(**s) for s in steps]), tools)

    ok = problems({"skill": "count"}, {"skill": "write_file",
                                       "args": {"file_path": "/tmp/y", "content": ref("steps.1.result.items.0")}})
    assert ok == []  # the $ref object stands where a string is required: not a schema error
    [later] = problems({"skill": "write_file", "args": {"file_path": "/tmp/y", "content": ref("steps.2.result")}},
                       read)
    assert "step 1 (write_file): bad reference at content" in later and "the first step has no earlier" in later
    [itself] = problems(read, {"skill": "write_file",
                               "args": {"file_path": "/tmp/y", "content": ref("steps.2.result.content")}})
    assert "names step 2, but a step can only use steps before it (1 to 1)" in itself
    [syntax] = problems(read, {"skill": "write_file", "args": {"file_path": "/tmp/y",
                                                               "content": ref("steps[0].result.content")}})
    assert "is not a reference" in syntax and "steps.1.result.stdout" in syntax
    [template] = problems(read, {"skill": "write_file", "args": {"file_path": "/tmp/y",
                                                                 "content": "{{steps[0].result.content}}"}})
    assert "text templates" in template and '{"$ref"' in template
    [schema] = problems({"skill": "count"}, {"skill": "write_file",
                                             "args": {"file_path": "/tmp/y", "content": ref("steps.1.result.sum")}})
    assert "does not fit count's output: the result has no key 'sum' (its keys: items, total)" in schema
    [kind] = problems({"skill": "count"}, {"skill": "write_file",
                                           "args": {"file_path": "/tmp/y", "content": ref("steps.1.result.total.x")}})
    assert "total is integer, not an object" in kind
    [extra] = problems(read, {"skill": "write_file", "args": {"file_path": "/tmp/y",
                                                              "content": {"$ref": "steps.1.result", "x": 1}}})
    assert "only the key $ref" in extra


def test_resolve_and_parse() -> None:
    assert parse_ref("steps.3.result.entries[2].name") == (3, ["entries", 2, "name"])
    assert parse_ref("steps.1.result") == (1, [])
    results = {1: {"stdout": "hi", "rows": [{"n": 1}]}}
    args = {"a": ref("steps.1.result.stdout"), "b": [ref("steps.1.result.rows.0.n")], "c": ref("steps.1.result")}
    assert resolve(args, results) == {"a": "hi", "b": [1], "c": results[1]}
    with pytest.raises(RefError, match=r"has no key 'stderr' \(its keys: rows, stdout\)"):
        resolve(ref("steps.1.result.stderr"), results)
    with pytest.raises(RefError, match="has 1 items, no item 3"):
        resolve(ref("steps.1.result.rows.3"), results)
    with pytest.raises(RefError, match="step 2 has no result"):
        resolve(ref("steps.2.result"), results)


async def test_unresolved_reference_is_replanned(device: LocalDevice, work: Path) -> None:  # noqa: F811
    (work / "notes.txt").write_text("the notes")
    first = {"steps": [{"skill": "read_file", "args": {"file_path": str(work / "notes.txt")}},
                       {"skill": "write_file", "args": {"file_path": str(work / "copy.txt"),
                                                        "content": ref("steps.1.result.text")}}]}
    second = {"steps": [{"skill": "write_file", "args": {"file_path": str(work / "copy.txt"),
                                                         "content": ref("steps.1.result.content")}}]}
    async with FakeLLM([reply(first), reply(second), "Copied."]) as fake, LLMClient(fake.settings()) as llm:
        runner = await make_runner(device, llm, Asker())
        task = await runner.run(Task(request="copy notes.txt to copy.txt"))
    assert task.state is TaskState.DONE, task.error
    assert (work / "copy.txt").read_text() == "the notes"
    failed = task.steps[1]
    assert not failed.result.ok and "'steps.1.result.text' does not resolve" in (failed.result.error or "")
    assert "has no key 'text' (its keys:" in (failed.result.error or "")
    assert failed.decision and failed.decision["decision"] == "REPLAN" and failed.decision["source"] == "fast_path"
    assert task.counters.commands == 2  # the unresolved step sent nothing
    replan_prompt = fake.requests[1]["messages"][-1]["content"]
    assert "has no key 'text'" in replan_prompt and "content" in replan_prompt
    # the re-planned step 2 still reads step 1: numbers count on across the plan's parts
    assert json.dumps(task.plan.steps[1].args["content"]) == json.dumps(ref("steps.1.result.content"))  # type: ignore[union-attr]


async def test_unresolved_reference_without_llm_asks(device: LocalDevice, work: Path) -> None:  # noqa: F811
    plan = plan_of({"skill": "shell.run", "args": {"cmd": "true", "argv": [], "cwd": str(work)}},
                   {"skill": "write_file", "args": {"file_path": str(work / "out.txt"),
                                                    "content": ref("steps.1.result.nothing")}})
    ask = Asker("cancel")
    runner: TaskRunner = await make_runner(device, None, ask)
    task = await runner.run(Task(request="write", plan=plan))
    assert task.state is TaskState.CANCELLED
    [question] = ask.questions
    assert "Step 2" in question.question and "cannot run" in question.question
    assert question.options == ["skip this step", "cancel"] or "cancel" in question.options
    assert not (work / "out.txt").exists()


def test_prompt_teaches_references_and_observation() -> None:
    from tether.agent.planning.device_view import DeviceView

    [system, _] = build_messages("x", {"local": DeviceView(tools=files_toolset().infos())}, "policy")
    text = system["content"]
    assert "steps count from 1" in text and "never filled in" in text
    assert "get_ui_tree" in text and "browser.act snapshot" in text


async def test_a_plan_that_knows_its_answer_saves_the_answer_call(device: LocalDevice, work: Path) -> None:  # noqa: F811
    notes, nas = work / "notes", work / "nas"
    notes.mkdir()
    nas.mkdir()
    (notes / "todo.txt").write_text("milk")
    plan = {"steps": backup_steps(notes, nas), "answer": "Your notes are on the nas."}
    async with FakeLLM([reply(plan)]) as fake, LLMClient(fake.settings()) as llm:
        runner = await make_runner(device, llm, Asker())
        task = await runner.run(Task(request="back up my notes"))
    assert task.state is TaskState.DONE and task.answer == "Your notes are on the nas."
    assert len(fake.requests) == 1 and (nas / "todo.txt").read_text() == "milk"
    # a step that failed on the way: the planned reply may be wrong, so the LLM writes the answer
    (nas / "todo.txt").unlink()
    missing = {"steps": [{"skill": "read_file", "args": {"file_path": str(notes / "gone.txt")}}], "answer": "Read."}
    decision = {"decision": "REPLAN", "suggestion": "read todo.txt", "constraint": None, "alternative_cwd": None}
    again = {"steps": [{"skill": "read_file", "args": {"file_path": str(notes / "todo.txt")}}], "answer": "Read."}
    async with FakeLLM([reply(missing), reply(decision), reply(again), "It says milk."]) as fake, \
            LLMClient(fake.settings()) as llm:
        runner = await make_runner(device, llm, Asker())
        task = await runner.run(Task(request="read my note"))
    assert task.state is TaskState.DONE and task.answer == "It says milk.", task.error
