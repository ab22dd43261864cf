"""Recovery decisions and the task state machine, without a device."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from bench.kit.fake_llm import FakeLLM, HTTPFailure
from tether.agent.llm.chat import LLMClient
from tether.agent.planning.plan import PlanStep
from tether.agent.run.decisions import (
    DECISION_ADAPTER,
    AskUser,
    AutoPatch,
    DecisionError,
    RecoveryInput,
    Replan,
    parse_decision,
    validate_decision,
)
from tether.agent.run.recovery import fast_path, recover, tool_for
from tether.agent.run.task import Budgets, InvalidTransition, Task, TaskState
from tether.protocol.models import Result
from tether.tools.files.tool import files_toolset
from tether.tools.shell.tool import shell_toolset

TOOLS = {None: shell_toolset().infos() + files_toolset().infos()}


def inp(step: PlanStep, error: str, result: object = None, **kw: object) -> RecoveryInput:
    return RecoveryInput(request="r", step=step, index=0, result=Result.failure(error, result=result),
                         tool=tool_for(step, TOOLS), **kw)


def test_state_machine_refuses_invalid_transitions() -> None:
    task = Task(request="x")
    with pytest.raises(InvalidTransition, match="created to done"):
        task.transition(TaskState.DONE)
    task.transition(TaskState.PLANNING)
    task.transition(TaskState.RUNNING)
    task.transition(TaskState.RECOVERING)
    with pytest.raises(InvalidTransition):
        task.transition(TaskState.DONE)
    task.transition(TaskState.WAITING_FOR_USER)
    task.transition(TaskState.RUNNING)
    task.transition(TaskState.DONE)
    for state in TaskState:
        if state is not TaskState.DONE:
            with pytest.raises(InvalidTransition, match="has ended"):
                task.transition(state)
    assert [e.data["to"] for e in task.events] == ["planning", "running", "recovering", "waiting_for_user",
                                                   "running", "done"]
    assert [e.seq for e in task.events] == list(range(6))


def test_decisions_are_a_discriminated_union() -> None:
    decision = DECISION_ADAPTER.validate_python({"decision": "REPLAN", "suggestion": "s"})
    assert isinstance(decision, Replan)
    with pytest.raises(ValidationError):
        DECISION_ADAPTER.validate_python({"decision": "ASK_USER", "question": "q", "options": []})
    with pytest.raises(ValidationError):
        DECISION_ADAPTER.validate_python({"decision": "EXPLODE"})


def test_patch_validated_against_schema() -> None:
    tool = tool_for(PlanStep(skill="write_file"), TOOLS)
    assert validate_decision(AutoPatch(patched_args={"file_path": "/tmp/x", "content": "c"}), tool) == []
    assert validate_decision(AutoPatch(patched_args={"content": 3}), tool)
    with pytest.raises(DecisionError, match="patched_args"):
        parse_decision(json.dumps({"decision": "AUTO_PATCH", "patched_args": {"nope": 1}}), tool)
    with pytest.raises(DecisionError, match="not a JSON object"):
        parse_decision("sorry, I cannot help", tool)
    fenced = "Here:\n```json\n" + json.dumps({"decision": "ask_user", "question": "q?", "options": ["a"]}) + "\n```"
    assert isinstance(parse_decision(fenced), AskUser)


def test_fast_paths() -> None:
    mkdir = PlanStep(skill="shell.run", args={"cmd": "mkdir", "argv": ["/w/a/b"], "cwd": "/w"})
    patch = fast_path(inp(mkdir, "exit code 1: mkdir: cannot create directory '/w/a/b': No such file or directory"))
    assert isinstance(patch, AutoPatch) and patch.patched_args["argv"] == ["-p", "/w/a/b"]

    write = PlanStep(skill="write_file", args={"file_path": "/w/a/f", "content": "c"})
    patch = fast_path(inp(write, "write_file: parent directory does not exist: /w/a (pass create_parents=true)"))
    assert isinstance(patch, AutoPatch) and patch.patched_args["create_parents"] is True

    sleep = PlanStep(skill="shell.run", args={"cmd": "sleep", "argv": ["9"], "cwd": "/w", "timeoutMs": 400_000})
    patch = fast_path(inp(sleep, "`sleep 9` timed out after 400s", {"timedOut": True}))
    assert isinstance(patch, AutoPatch) and patch.patched_args["timeoutMs"] == 600_000  # capped
    capped = PlanStep(skill="shell.run", args={**sleep.args, "timeoutMs": 600_000})
    assert isinstance(fast_path(inp(capped, "timed out after 600s")), AskUser)

    rm = PlanStep(skill="shell.run", args={"cmd": "rm", "argv": ["x"], "cwd": "/w"})
    ask = fast_path(inp(rm, "needs approval (policy rule 'approval.delete'): ...",
                        {"needs_approval": True, "rule": "approval.delete"}))
    assert isinstance(ask, AskUser) and ask.kind == "approval" and ask.options == ["approve", "deny"]

    mk_root = PlanStep(skill="shell.run", args={"cmd": "mkdir", "argv": ["/myfolder"], "cwd": "/"})
    ask = fast_path(inp(mk_root, "exit code 1: mkdir: cannot create directory '/myfolder': Permission denied"))
    assert isinstance(ask, AskUser) and ask.options == ["use ~/Desktop instead", "choose another location", "cancel"]
    ask = fast_path(inp(mk_root, "denied by policy rule 'read_roots': '/' is outside the allowed roots",
                        can_replan=False))
    assert isinstance(ask, AskUser) and "cancel" in ask.options and "use ~/Desktop instead" not in ask.options

    prog = PlanStep(skill="shell.run", args={"cmd": "frob", "argv": [], "cwd": "/w"})
    assert isinstance(fast_path(inp(prog, "could not start frob: No such file or directory")), AskUser)
    assert fast_path(inp(prog, "exit code 3: something odd")) is None


async def test_budgets_turn_decisions_into_ask_user() -> None:
    step = PlanStep(skill="write_file", args={"file_path": "/w/a/f", "content": "c"})
    # the fast path would patch, but the patch budget is spent
    decision = await recover(inp(step, "parent directory does not exist: /w/a", patches_used=2), None, Budgets())
    assert isinstance(decision, AskUser) and decision.source == "budget"
    # the same patch again
    again = {**step.args, "create_parents": True}
    decision = await recover(inp(step, "parent directory does not exist", tried_args=[again]), None)
    assert isinstance(decision, AskUser) and "same fix" in decision.question


async def test_llm_error_and_no_llm_fall_back_to_ask_user() -> None:
    step = PlanStep(skill="read_file", args={"file_path": "/w/x"})
    decision = await recover(inp(step, "exit code 7: odd"), None)
    assert isinstance(decision, AskUser) and "No LLM" in decision.question
    failing = [HTTPFailure(500, "boom")] * 5  # every output mode fails: an error, not a refusal of one
    async with FakeLLM([*failing, json.dumps({"decision": "REPLAN", "suggestion": "s"})]) as fake, \
            LLMClient(fake.settings()) as llm:
        decision = await recover(inp(step, "exit code 7: odd"), llm)
        assert isinstance(decision, AskUser) and decision.source == "fallback" and "boom" in decision.question
        decision = await recover(inp(step, "exit code 7: odd", replans_used=2), llm, Budgets(replans_per_task=2))
        assert isinstance(decision, AskUser) and "re-planned 2" in decision.question
