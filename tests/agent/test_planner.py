"""The planner and the plan shape, through the real `openai` client against a scripted Chat Completions server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.kit.fake_llm import FakeLLM
from tether.agent.llm.chat import LLMClient, LLMError
from tether.agent.planning.device_view import DeviceView
from tether.agent.planning.plan import Plan, PlanError, PlanStep, load_plan_file, validate_plan
from tether.agent.planning.planner import PlanningError, parse_plan_reply, plan_request
from tether.protocol.profile import DeviceProfile, OSInfo
from tether.tools.files.tool import files_toolset
from tether.tools.shell.tool import shell_toolset

POLICY = ("- never use sudo\n- shell.run takes argv as a list, never a shell string\n"
          "- cwd is required and must lie inside the allowed roots: /home/demo")
REQUEST = "create a folder demo in my home and add hello-world.txt to it"

GOOD_PLAN = {"steps": [
    {"skill": "shell.run", "args": {"cmd": "mkdir", "argv": ["-p", "demo"], "cwd": "/home/demo"},
     "description": "make the folder"},
    {"skill": "write_file", "args": {"file_path": "/home/demo/demo/hello-world.txt", "content": "hello"},
     "description": "write the file", "device": None},
]}


def tools() -> list:
    return shell_toolset().infos() + files_toolset().infos()


def devices() -> dict[str, DeviceView]:
    profile = DeviceProfile(os=OSInfo(platform="linux", release="6.1"), tags=["laptop"])
    return {"laptop": DeviceView(tools=tools(), profile=profile)}


async def test_valid_plan_on_first_try() -> None:
    async with FakeLLM([json.dumps(GOOD_PLAN)]) as fake, LLMClient(fake.settings()) as llm:
        result = await plan_request(llm, REQUEST, devices=devices(), policy_summary=POLICY)
    assert result.attempts == 1 and result.llm_calls == 1 and result.prompt_tokens > 0
    assert [s.skill for s in result.plan.steps] == ["shell.run", "write_file"]
    assert result.plan.steps[0].args["cwd"] == "/home/demo"
    body = fake.requests[0]
    prompt = "\n".join(m["content"] for m in body["messages"])
    for needle in ("shell.run", "write_file", "read_file", "cmd*: string", "argv: string[]",
                   "never use sudo", "argv as a list", "/home/demo", REQUEST, "laptop", "linux"):
        assert needle in prompt, needle
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"]["required"] == ["steps", "answer"]  # strict: all
    assert body["response_format"]["json_schema"]["strict"] is True


async def test_history_and_recovery_context_reach_the_prompt() -> None:
    history = [{"skill": "shell.run", "args": {"cmd": "mkdir"}, "status": "failure", "error": "EACCES on /demo"}]
    async with FakeLLM([json.dumps(GOOD_PLAN)]) as fake, LLMClient(fake.settings()) as llm:
        await plan_request(llm, REQUEST, devices=devices(), policy_summary=POLICY, history=history,
                           recovery_context="permission denied on /; use the home directory")
    user = fake.requests[0]["messages"][-1]["content"]
    assert "EACCES on /demo" in user and "use the home directory" in user


@pytest.mark.parametrize("bad_step, expected", [
    ({"skill": "shell.exec", "args": {"cmd": "ls"}}, "unknown skill 'shell.exec'"),
    ({"skill": "shell.run", "args": {"cmd": "ls", "argv": "-la"}}, "bad args: argv"),
])
async def test_invalid_plan_then_valid_one(bad_step: dict, expected: str) -> None:
    bad = json.dumps({"steps": [bad_step]})
    fenced = "```json\n" + json.dumps(GOOD_PLAN) + "\n```"
    async with FakeLLM([bad, fenced]) as fake, LLMClient(fake.settings()) as llm:
        result = await plan_request(llm, REQUEST, devices=devices(), policy_summary=POLICY)
    assert result.attempts == 2 and result.llm_calls == 2
    assert len(result.plan.steps) == 2
    assert any(expected in p for p in result.first_problems)
    assert result.prompt_tokens == llm.prompt_tokens
    second = fake.requests[1]["messages"]
    assert second[-2] == {"role": "assistant", "content": bad}
    assert expected in second[-1]["content"] and "problems" in second[-1]["content"]


async def test_invalid_twice_is_a_planning_error() -> None:
    bad = json.dumps({"steps": [{"skill": "rm_rf", "args": {}}]})
    async with FakeLLM([bad, "not json at all"]) as fake, LLMClient(fake.settings()) as llm:
        with pytest.raises(PlanningError) as info:
            await plan_request(llm, REQUEST, devices=devices(), policy_summary=POLICY)
    assert info.value.attempts == 2 and "not a JSON plan" in info.value.problems[0]
    assert "after 2 attempts" in str(info.value)
    assert len(fake.requests) == 2


async def test_planning_with_json_object_fallback() -> None:
    async with FakeLLM([json.dumps(GOOD_PLAN)], reject_json_schema=True) as fake, LLMClient(fake.settings()) as llm:
        result = await plan_request(llm, REQUEST, devices=devices(), policy_summary=POLICY)
    assert result.attempts == 1 and result.llm_calls == 2
    assert fake.requests[0]["response_format"] == {"type": "json_object"}


async def test_llm_errors_propagate() -> None:
    async with FakeLLM([]) as fake, LLMClient(fake.settings()) as llm:  # no reply left: HTTP 500
        with pytest.raises(LLMError, match="HTTP 500"):
            await plan_request(llm, REQUEST, devices=devices(), policy_summary=POLICY)


async def test_streamed_planning() -> None:
    tokens: list[str] = []
    async with FakeLLM([json.dumps(GOOD_PLAN)]) as fake, LLMClient(fake.settings()) as llm:
        result = await plan_request(llm, REQUEST, devices=devices(), policy_summary=POLICY,
                                    stream=True, on_token=tokens.append)
    assert len(result.plan.steps) == 2 and "".join(tokens) == json.dumps(GOOD_PLAN)


# -- parsing and validation ------------------------------------------------------------------------


def test_parse_tolerates_fences_prose_and_bare_lists() -> None:
    steps = GOOD_PLAN["steps"]
    assert len(parse_plan_reply("Here is the plan:\n```json\n" + json.dumps(GOOD_PLAN) + "\n```").steps) == 2
    assert len(parse_plan_reply("Sure! " + json.dumps(GOOD_PLAN) + " Done.").steps) == 2
    assert len(parse_plan_reply(json.dumps(steps)).steps) == 2
    with pytest.raises(PlanError, match="step 1"):
        parse_plan_reply(json.dumps([{"args": {}}]))


def test_validate_plan_devices() -> None:
    shell_only = shell_toolset().infos()
    tools_by_device = {"a": shell_only, "b": shell_only + files_toolset().infos()}
    plan = Plan(steps=[
        PlanStep(skill="write_file", args={"file_path": "/tmp/x", "content": "x"}),  # only on b: fine
        PlanStep(skill="write_file", args={"file_path": "/tmp/x", "content": "x"}, device="a"),
        PlanStep(skill="shell.run", args={"cmd": "ls"}, device="c"),
        PlanStep(skill="read_file", args={"path": "/tmp/x"}, device="b"),
    ])
    problems = validate_plan(plan, tools_by_device)
    assert len(problems) == 4
    assert problems[0].startswith("step 2 (write_file): unknown skill 'write_file' on device 'a'")
    assert "unknown device 'c'" in problems[1] and "known devices: a, b" in problems[1]
    assert all(p.startswith("step 4 (read_file): bad args") for p in problems[2:])
    assert any("'file_path' is a required property" in p for p in problems[2:])
    assert any("'path' was unexpected" in p for p in problems[2:])
    assert validate_plan(Plan(steps=[]), tools_by_device) == ["the plan has no steps"]


def test_validate_plan_default_device() -> None:
    plan = Plan(steps=[PlanStep(skill="shell.run", args={"cmd": "ls", "timeoutMs": 0})])
    problems = validate_plan(plan, {None: shell_toolset().infos()})
    assert len(problems) == 1 and "timeoutMs" in problems[0]


# -- plan files ------------------------------------------------------------------------------------


def test_load_yaml_plan(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(
        "- skill: shell.run\n"
        "  args: {cmd: mkdir, argv: [demo], cwd: /home/demo}\n"
        "  description: make the folder\n"
        "- skill: write_file\n"
        "  args:\n"
        "    file_path: /home/demo/demo/hello-world.txt\n"
        "    content: hello\n"
        "  device: laptop\n")
    plan = load_plan_file(path)
    assert [s.skill for s in plan.steps] == ["shell.run", "write_file"]
    assert plan.steps[1].device == "laptop" and plan.steps[0].description == "make the folder"
    assert validate_plan(plan, {"laptop": tools()}) == []


def test_load_json_plan(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(GOOD_PLAN))
    plan = load_plan_file(path)
    assert len(plan.steps) == 2 and plan.steps[1].device is None


@pytest.mark.parametrize("name, text, expected", [
    ("bad.yaml", "- skill: shell.run\n  args: {cmd: ls}\n- args: {cmd: ls}\n", "step 2: skill: Field required"),
    ("bad.json", json.dumps([{"skill": "a"}, {"skill": "b"}, {"skill": "c", "arg": {}}]), "step 3: arg"),
    ("bad2.yaml", "- skill: shell.run\n- just a string\n", "step 2: a step is a mapping"),
    ("bad3.yaml", "skill: shell.run\n", "a plan is a list of steps"),
    ("broken.json", "[{", "not valid JSON"),
    ("broken.yaml", "- [unclosed\n", "not valid YAML"),
])
def test_plan_file_errors_name_file_and_step(tmp_path: Path, name: str, text: str, expected: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(PlanError) as info:
        load_plan_file(path)
    assert str(path) in str(info.value) and expected in str(info.value)


def test_missing_plan_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read the plan file"):
        load_plan_file(tmp_path / "nope.yaml")
