"""What the task benchmarks share (bench/tasks.py, bench/look_tasks.py): the device, plan and loop replies,
the naive loop agent, and LLM usage counted by kind of call."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from tether.agent.llm.chat import LLMClient
from tether.agent.planning.planner import DEFAULT_POLICY_SUMMARY, compact_schema
from tether.agent.run.decisions import AskUser
from tether.device.config import parse_device_config
from tether.device.local import LocalDevice, build_device
from tether.protocol.dispatcher import BasicCommandDispatcher
from tether.protocol.models import Command, ToolInfo
from tether.tools.policy.model import default_policy

LOOP_RESULT_CHARS = 600  # the planner cuts each history item to 600 characters too
LOOP_MAX_CALLS = 30
Json = dict[str, Any]


def agent_fakes() -> ModuleType:
    """`bench/kit/fake_llm.py` (FakeLLM), imported when a measurement first needs it."""
    return importlib.import_module("bench.kit.fake_llm")


# ---------------------------------------------------------------------------------------------- the device

def make_device(root: Path) -> LocalDevice:
    """A local device as `tether run` builds it, with the built-in shell, files and system tools only (so the
    tool list, and with it the prompts, is the same on every machine), jailed to `root`."""
    config = parse_device_config({"device": {"name": "bench", "builtin": ["shell", "files", "system"]}})
    policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
    return build_device(config, policy=policy, state_dir=root / "state")


async def no_questions(question: AskUser) -> str:
    raise AssertionError(f"the benchmark's tasks ask nothing, but tether asked: {question.question}")


def step(skill: str, args: Json, description: str = "") -> Json:
    return {"skill": skill, "args": args, "description": description}


def mkdir(path: Path, cwd: Path, *flags: str) -> Json:
    return step("shell.run", {"cmd": "mkdir", "argv": [*flags, str(path)], "cwd": str(cwd)}, f"create {path.name}")


def write(path: Path, content: str, **extra: Any) -> Json:
    return step("write_file", {"file_path": str(path), "content": content, **extra}, f"write {path.name}")


def read(path: Path) -> Json:
    return step("read_file", {"file_path": str(path)}, f"read {path.name}")


def listing(path: Path) -> Json:
    return step("list_dir", {"path": str(path)}, f"list {path.name}")


def plan_reply(*steps: Json) -> str:
    return json.dumps({"steps": list(steps)})


def act(s: Json) -> str:
    return json.dumps({"action": {"skill": s["skill"], "args": s["args"]}})


def done(answer: str) -> str:
    return json.dumps({"done": True, "answer": answer})


# ---------------------------------------------------------------------------------------------- the loop

LOOP_JSON_SCHEMA: Json = {
    "type": "object",
    "properties": {
        "action": {"type": "object", "properties": {"skill": {"type": "string"}, "args": {"type": "object"}},
                   "required": ["skill", "args"]},
        "done": {"type": "boolean"},
        "answer": {"type": "string"},
    },
    "additionalProperties": False,
}


def first_paragraph(text: str, limit: int = 240) -> str:
    paragraph = " ".join((text or "").strip().split("\n\n", 1)[0].split())
    return paragraph if len(paragraph) <= limit else paragraph[: limit - 1] + "…"


def loop_system_prompt(tools: list[ToolInfo]) -> str:
    """The loop's system prompt: the policy and the skills in the planner's own compact form."""
    lines = ["You are an automation agent. Reach the user's goal one skill call at a time: each turn, answer "
             "the next call, or done with a short answer once the goal is reached. Use only these skills, with "
             "arguments that match their schemas (* marks a required argument).", "",
             "Policy (calls that break it are refused):", DEFAULT_POLICY_SUMMARY, "", "Skills:"]
    for tool in tools:
        lines.append(f"- {tool.name} [{tool.tool_type}]: {first_paragraph(tool.description)}".rstrip(": "))
        lines.append(f"  args: {compact_schema(tool.input_schema)}")
    lines += ["", 'Answer with one JSON object only: {"action": {"skill": "...", "args": {...}}} for the next '
              'call, or {"done": true, "answer": "..."} when the goal is reached. After each call you get its '
              "result; when it failed, fix the call or try another way."]
    return "\n".join(lines)


def observation(result: Any) -> str:
    text = json.dumps({"status": result.status.value, "error": result.error, "result": result.result},
                      default=str)
    return text if len(text) <= LOOP_RESULT_CHARS else text[:LOOP_RESULT_CHARS] + "…"


@dataclass
class LoopOutcome:
    answer: str | None
    commands: int
    failures: int


async def run_loop(llm: LLMClient, dispatcher: BasicCommandDispatcher, tools: list[ToolInfo],
                   request: str) -> LoopOutcome:
    """The naive agent: one chat completion per step, each carrying the whole history so far."""
    messages: list[Json] = [{"role": "system", "content": loop_system_prompt(tools)},
                            {"role": "user", "content": f"Goal: {request}"}]
    commands = failures = 0
    for _ in range(LOOP_MAX_CALLS):
        reply = await llm.complete(messages, json_schema=LOOP_JSON_SCHEMA, schema_name="action")
        data = json.loads(reply.text)
        if data.get("done"):
            return LoopOutcome(str(data.get("answer", "")), commands, failures)
        action = data["action"]
        [result] = await dispatcher.execute_commands([Command(tool_name=action["skill"],
                                                              parameters=action["args"])])
        commands += 1
        failures += not result.ok
        messages += [{"role": "assistant", "content": reply.text},
                     {"role": "user", "content": f"Result: {observation(result)}"}]
    return LoopOutcome(None, commands, failures)


KIND_ORDER = ("plan", "recovery", "answer", "action")


@dataclass
class Usage:
    """LLM calls and prompt tokens (in all, and by kind of call: plan, recovery, answer; action for the loop)
    and the commands sent for one task, or summed over tasks."""

    calls: int = 0
    prompt_tokens: int = 0
    kind_calls: dict[str, int] = field(default_factory=dict)
    kind_tokens: dict[str, int] = field(default_factory=dict)
    commands: int = 0
    failures: int = 0

    def add_call(self, kind: str, tokens: int) -> None:
        self.kind_calls[kind] = self.kind_calls.get(kind, 0) + 1
        self.kind_tokens[kind] = self.kind_tokens.get(kind, 0) + tokens

    def merge(self, other: Usage) -> None:
        self.calls += other.calls
        self.prompt_tokens += other.prompt_tokens
        self.commands += other.commands
        self.failures += other.failures
        for kind, n in other.kind_calls.items():
            self.kind_calls[kind] = self.kind_calls.get(kind, 0) + n
        for kind, n in other.kind_tokens.items():
            self.kind_tokens[kind] = self.kind_tokens.get(kind, 0) + n

    def kinds(self) -> str:
        return "+".join(f"{self.kind_calls[k]}{k[0]}" for k in KIND_ORDER if k in self.kind_calls)


def kind_of(body: Json) -> str:
    """What a request to the FakeLLM was for, from the JSON schema's name (plan, recovery, action) or none."""
    fmt = body.get("response_format") or {}
    return str((fmt.get("json_schema") or {}).get("name") or "answer")


def usage_of(requests: list[Json], calls: int, prompt_tokens: int, commands: int, failures: int) -> Usage:
    """The usage as the LLM client counted it, split by kind from the requests the FakeLLM received."""
    fakes = agent_fakes()
    usage = Usage(calls, prompt_tokens, commands=commands, failures=failures)
    for body in requests:
        usage.add_call(kind_of(body), fakes.prompt_tokens_of(body))
    if sum(usage.kind_tokens.values()) != prompt_tokens or sum(usage.kind_calls.values()) != calls:
        raise AssertionError(f"the client counted {calls} calls, {prompt_tokens} tokens; the FakeLLM saw "
                             f"{usage.kind_calls}, {usage.kind_tokens}")
    return usage
