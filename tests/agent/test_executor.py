"""The task runner against a real local device (built-in tools, a tmp state dir) and a scripted LLM server."""

from __future__ import annotations

import json
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bench.kit.fake_llm import FakeLLM
from tether.agent.llm.chat import LLMClient
from tether.agent.llm.settings import how_to_configure
from tether.agent.planning.plan import Plan, PlanStep
from tether.agent.run.decisions import AskUser
from tether.agent.run.executor import TaskRunner
from tether.agent.run.steps import discover_tools
from tether.agent.run.task import Budgets, Task, TaskEvent, TaskState
from tether.device.local import LocalDevice, build_device
from tether.protocol.models import ToolInfo
from tether.tools.policy.model import default_policy


@pytest.fixture
async def device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LocalDevice]:
    # The device's temp dir lies outside tmp_path, so deleting in tmp_path needs approval.
    other_temp = tmp_path / "device-temp"
    other_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(other_temp))
    work = tmp_path / "work"
    work.mkdir()
    policy = default_policy().model_copy(update={"read_roots": [str(tmp_path)], "write_roots": [str(tmp_path)]})
    dev = build_device(policy=policy, state_dir=tmp_path / "state")
    assert dev.context.temp_dir == str(other_temp)
    yield dev
    await dev.aclose()


@pytest.fixture
def work(tmp_path: Path) -> Path:
    return tmp_path / "work"


class Asker:
    """Answers questions from a script and remembers them."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.questions: list[AskUser] = []

    async def __call__(self, question: AskUser) -> str:
        self.questions.append(question)
        if not self.answers:
            raise AssertionError(f"unexpected question: {question.question} {question.options}")
        return self.answers.pop(0)


async def make_runner(device: LocalDevice, llm: LLMClient | None, ask: Asker,
                      events: list[TaskEvent] | None = None, **kwargs: Any) -> TaskRunner:
    dispatcher = device.dispatcher(session_id="task")
    tools: dict[str | None, list[ToolInfo]] = {None: await discover_tools(dispatcher)}
    return TaskRunner(lambda name: dispatcher, llm, tools=tools, ask=ask,
                      on_event=events.append if events is not None else None, **kwargs)


def mkdir(path: Path, cwd: Path, *flags: str) -> dict[str, Any]:
    return {"skill": "shell.run", "args": {"cmd": "mkdir", "argv": [*flags, str(path)], "cwd": str(cwd)},
            "description": f"create {path.name}"}


def write(path: Path, content: str) -> dict[str, Any]:
    return {"skill": "write_file", "args": {"file_path": str(path), "content": content},
            "description": f"write {path.name}"}


def plan_of(*steps: dict[str, Any]) -> Plan:
    return Plan(steps=[PlanStep(**s) for s in steps])


def reply(obj: Any) -> str:
    return json.dumps(obj)


def kinds(task: Task) -> list[str]:
    return [e.kind for e in task.events]


async def test_hand_written_plan_runs_without_llm(device: LocalDevice, work: Path) -> None:
    events: list[TaskEvent] = []
    ask = Asker()
    runner = await make_runner(device, None, ask, events)
    plan = plan_of(mkdir(work / "demo", work),
                   write(work / "demo" / "hello-world.txt", "hello"),
                   {"skill": "shell.run", "args": {"cmd": "echo", "argv": ["hi there"], "cwd": str(work)}})
    task = await runner.run(Task(request="make a demo folder", plan=plan))
    assert task.state is TaskState.DONE, task.error
    assert (work / "demo" / "hello-world.txt").read_text() == "hello"
    assert task.cursor == 3 and len(task.steps) == 3 and all(r.result.ok for r in task.steps)
    assert task.counters.llm_calls == 0 and not ask.questions
    assert "3 of 3" in (task.answer or "")
    assert events == task.events  # every event was streamed as it happened
    outputs = [e for e in task.events if e.kind == "output"]
    assert any("hi there" in e.data.get("data", "") and e.data["step"] == 2 for e in outputs)
    states = [e.data["to"] for e in task.events if e.kind == "state"]
    assert states == ["running", "done"]
    # the whole task serializes and comes back equal
    assert Task.model_validate_json(task.model_dump_json()) == task


async def test_missing_parent_fixed_by_fast_path(device: LocalDevice, work: Path) -> None:
    runner = await make_runner(device, None, Asker())
    plan = plan_of(mkdir(work / "a" / "b", work), write(work / "x" / "y" / "z.txt", "deep"))
    task = await runner.run(Task(request="nested", plan=plan))
    assert task.state is TaskState.DONE, task.error
    assert (work / "a" / "b").is_dir() and (work / "x" / "y" / "z.txt").read_text() == "deep"
    decisions = [r.decision for r in task.steps if r.decision]
    assert [d["decision"] for d in decisions] == ["AUTO_PATCH", "AUTO_PATCH"]
    assert all(d["source"] == "fast_path" for d in decisions)
    assert task.plan is not None and task.plan.steps[0].args["argv"][0] == "-p"
    assert task.plan.steps[1].args["create_parents"] is True
    assert task.counters.patches == {"0": 1, "1": 1}


async def test_timeout_fast_path_doubles_timeout(device: LocalDevice, work: Path) -> None:
    runner = await make_runner(device, None, Asker("cancel"), budgets=Budgets(patches_per_step=1))
    plan = plan_of({"skill": "shell.run", "args": {"cmd": "sleep", "argv": ["5"], "cwd": str(work), "timeoutMs": 50}})
    task = await runner.run(Task(request="sleep", plan=plan))
    # one patch (50 → 100 ms) still times out; the budget of 1 then asks the user, who cancels
    assert [r.command.parameters["timeoutMs"] for r in task.steps] == [50, 100]
    assert task.state is TaskState.CANCELLED


async def test_llm_auto_patch_fixes_step(device: LocalDevice, work: Path) -> None:
    (work / "notes.txt").write_text("the notes")
    plan = plan_of({"skill": "read_file", "args": {"file_path": str(work / "note.txt")}, "description": "read notes"})
    patch = {"decision": "AUTO_PATCH", "patched_args": {"file_path": str(work / "notes.txt")},
             "note": "the file is notes.txt"}
    async with FakeLLM([reply(patch), "The notes say: the notes."]) as fake, LLMClient(fake.settings()) as llm:
        events: list[TaskEvent] = []
        runner = await make_runner(device, llm, Asker(), events)
        task = await runner.run(Task(request="read my notes", plan=plan))
    assert task.state is TaskState.DONE, task.error
    assert [r.result.ok for r in task.steps] == [False, True]
    assert task.steps[0].decision and task.steps[0].decision["source"] == "llm"
    assert task.steps[1].result.result["content"] == "the notes"
    assert task.answer == "The notes say: the notes."
    assert "".join(e.data["text"] for e in task.events if e.kind == "token") == task.answer
    assert task.counters.llm_calls == 2 and len(fake.requests) == 2
    assert fake.requests[0]["response_format"]["type"] == "json_schema"


async def test_llm_plans_and_replans_remaining_steps(device: LocalDevice, work: Path) -> None:
    first = {"steps": [mkdir(work / "proj", work),
                       {"skill": "read_file", "args": {"file_path": str(work / "proj" / "missing.cfg")}},
                       write(work / "proj" / "never.txt", "never")]}
    second = {"steps": [write(work / "proj" / "config.cfg", "fresh")]}
    decision = {"decision": "REPLAN", "suggestion": "create the config instead of reading it",
                "constraint": "do not read missing files", "alternative_cwd": None}
    async with FakeLLM([reply(first), reply(decision), reply(second), "Created proj/config.cfg."]) as fake, \
            LLMClient(fake.settings()) as llm:
        runner = await make_runner(device, llm, Asker())
        task = await runner.run(Task(request="set up proj with a config"))
    assert task.state is TaskState.DONE, task.error
    # the failed step and everything after it were replaced; the failed attempt stays in the log
    assert task.plan is not None and [s.skill for s in task.plan.steps] == ["shell.run", "write_file"]
    assert task.plan.steps[1].args["file_path"].endswith("config.cfg")
    assert [r.step.skill for r in task.steps] == ["shell.run", "read_file", "write_file"]
    assert (work / "proj" / "config.cfg").read_text() == "fresh" and not (work / "proj" / "never.txt").exists()
    assert task.counters.replans == 1 and task.counters.llm_calls == 4
    replan_prompt = fake.requests[2]["messages"][-1]["content"]
    assert "do not read missing files" in replan_prompt and "missing.cfg" in replan_prompt
    states = [e.data["to"] for e in task.events if e.kind == "state"]
    assert states == ["planning", "running", "recovering", "planning", "running", "done"]


async def test_ask_user_answer_resumes_same_task(device: LocalDevice, work: Path) -> None:
    plan = plan_of({"skill": "read_file", "args": {"file_path": str(work / "which.txt")}, "description": "read"})
    (work / "b.txt").write_text("bee")
    question = {"decision": "ASK_USER", "question": "Which file did you mean?", "options": ["a.txt", "b.txt"]}
    patched = {"steps": [{"skill": "read_file", "args": {"file_path": str(work / "b.txt")}}]}
    async with FakeLLM([reply(question), reply(patched), "It says bee."]) as fake, LLMClient(fake.settings()) as llm:
        ask = Asker("b.txt")
        runner = await make_runner(device, llm, ask)
        task = Task(request="read the file")
        task.plan = plan
        done = await runner.run(task)
    assert done is task and task.state is TaskState.DONE, task.error
    assert ask.questions[0].question == "Which file did you mean?"
    assert task.questions[0].answer == "b.txt" and task.questions[0].answered_at is not None
    assert "b.txt" in fake.requests[1]["messages"][-1]["content"]  # the answer went in as a constraint
    assert task.steps[-1].result.result["content"] == "bee"


@pytest.mark.parametrize("answer", ["deny", "approve"])
async def test_approval_denied_or_approved(device: LocalDevice, work: Path, answer: str) -> None:
    victim = work / "old"
    victim.mkdir()
    (victim / "f.txt").write_text("x")
    plan = plan_of({"skill": "shell.run", "args": {"cmd": "rm", "argv": ["-r", str(victim)], "cwd": str(work)},
                    "description": "remove old"})
    ask = Asker(answer)
    runner = await make_runner(device, None, ask)
    task = await runner.run(Task(request="remove old", plan=plan))
    assert ask.questions[0].kind == "approval" and ask.questions[0].options == ["approve", "deny"]
    if answer == "deny":
        assert task.state is TaskState.CANCELLED and "not approved" in (task.error or "")
        assert victim.exists() and len(task.steps) == 1
    else:
        assert task.state is TaskState.DONE, task.error
        assert not victim.exists()
        assert [r.command.approved_by for r in task.steps] == [None, "user"]


async def test_same_patch_again_ends_in_ask_user(device: LocalDevice, work: Path) -> None:
    bad = str(work / "nope.txt")
    plan = plan_of({"skill": "read_file", "args": {"file_path": str(work / "missing.txt")}})
    same = {"decision": "AUTO_PATCH", "patched_args": {"file_path": bad}, "note": "try nope"}
    async with FakeLLM([reply(same)] * 10) as fake, LLMClient(fake.settings()) as llm:
        ask = Asker("cancel")
        runner = await make_runner(device, llm, ask)
        task = await runner.run(Task(request="read", plan=plan))
    assert task.state is TaskState.CANCELLED
    assert len(fake.requests) == 2 and task.counters.llm_calls == 2  # patch once, then the repeat is refused
    assert len(task.steps) == 2
    assert ask.questions[0].source == "budget" and "same fix" in ask.questions[0].question


async def test_patch_budget_ends_in_ask_user(device: LocalDevice, work: Path) -> None:
    plan = plan_of({"skill": "read_file", "args": {"file_path": str(work / "m0.txt")}})
    replies = [reply({"decision": "AUTO_PATCH", "patched_args": {"file_path": str(work / f"m{i}.txt")}})
               for i in range(1, 10)]
    async with FakeLLM(replies) as fake, LLMClient(fake.settings()) as llm:
        ask = Asker("cancel")
        runner = await make_runner(device, llm, ask, budgets=Budgets(patches_per_step=2))
        task = await runner.run(Task(request="read", plan=plan))
    assert task.state is TaskState.CANCELLED and len(task.steps) == 3 and len(fake.requests) == 3
    assert "budget is 2" in ask.questions[0].question


async def test_invalid_llm_reply_falls_back_to_ask_user(device: LocalDevice, work: Path) -> None:
    plan = plan_of({"skill": "read_file", "args": {"file_path": str(work / "missing.txt")}})
    async with FakeLLM(["not json at all", reply({"decision": "AUTO_PATCH", "patched_args": {"wrong": 1}})]) as fake, \
            LLMClient(fake.settings()) as llm:
        ask = Asker("retry", "skip this step")
        runner = await make_runner(device, llm, ask, stream_answer=False)
        fake.add("Nothing was read.")
        task = await runner.run(Task(request="read", plan=plan))
    assert [q.source for q in ask.questions] == ["fallback", "fallback"]
    assert "not usable" in ask.questions[0].question
    assert "patched_args" in ask.questions[1].question  # the schema check named the bad argument
    assert task.state is TaskState.DONE and "skipped" in kinds(task)


async def test_no_llm_and_no_plan_fails_clearly(device: LocalDevice) -> None:
    runner = await make_runner(device, None, Asker())
    task = await runner.run(Task(request="do something clever"))
    assert task.state is TaskState.FAILED and task.error == how_to_configure()
    assert "TETHER_LLM_BASE_URL" in task.error and "--plan" in task.error


async def test_invalid_hand_written_plan_fails_before_running(device: LocalDevice, work: Path) -> None:
    runner = await make_runner(device, None, Asker())
    task = await runner.run(Task(request="x", plan=plan_of({"skill": "teleport", "args": {}})))
    assert task.state is TaskState.FAILED and "unknown skill 'teleport'" in (task.error or "")
    assert not task.steps


async def test_total_steps_budget_fails(device: LocalDevice, work: Path) -> None:
    steps = [{"skill": "shell.run", "args": {"cmd": "true", "argv": [], "cwd": str(work)}}] * 4
    runner = await make_runner(device, None, Asker(), budgets=Budgets(total_steps=2))
    task = await runner.run(Task(request="x", plan=plan_of(*steps)))
    assert task.state is TaskState.FAILED and "budget of 2 commands" in (task.error or "")
    assert task.cursor == 2


async def test_planning_failure_with_llm_fails_task(device: LocalDevice) -> None:
    async with FakeLLM(["nope", "still nope"]) as fake, LLMClient(fake.settings()) as llm:
        runner = await make_runner(device, llm, Asker())
        task = await runner.run(Task(request="x"))
    assert task.state is TaskState.FAILED and "planning failed" in (task.error or "")


async def test_waiting_for_a_person_does_not_use_the_wall_time_budget(device: LocalDevice, work: Path) -> None:
    victim = work / "old"
    victim.mkdir()
    (victim / "f.txt").write_text("x")
    now = [0.0]

    async def person_back_after_an_hour(question: AskUser) -> str:
        now[0] += 3600.0
        return "approve"

    runner = await make_runner(device, None, person_back_after_an_hour,  # type: ignore[arg-type]
                               clock=lambda: now[0], budgets=Budgets(wall_time_s=60))
    plan = plan_of({"skill": "shell.run", "args": {"cmd": "rm", "argv": ["-r", str(victim)], "cwd": str(work)}},
                   write(work / "after.txt", "x"))
    task = await runner.run(Task(request="remove old", plan=plan))
    assert task.state is TaskState.DONE, task.error
    assert task.counters.elapsed_s < 60 and not victim.exists()
