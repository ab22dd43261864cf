"""The LLM client against real HTTP servers on 127.0.0.1 that answer as llama-cpp-python's OpenAI-compatible
server does: `json_schema` refused with a bare HTTP 500, a stream that never ends, a reply that never comes,
a runaway reply of garbage. Each server is a plain asyncio HTTP/1.1 server written here (no framework), so
what the `openai` SDK sees is exactly what is on the wire."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from tether.agent.llm.chat import LLMClient, LLMError
from tether.agent.llm.grammar import schema_to_gbnf
from tether.agent.llm.settings import LLMSettings
from tether.agent.planning.device_view import DeviceView
from tether.agent.planning.graph import ID_PATTERN
from tether.agent.planning.plan import PlanError
from tether.agent.planning.planner import PlanningError, build_messages, parse_plan_reply, plan_request
from tether.agent.planning.schema import plan_schema
from tether.tools.files.tool import files_toolset

Handler = Callable[[dict[str, Any], asyncio.StreamWriter], Awaitable[None]]
GOOD_PLAN = {"steps": [{"skill": "write_file", "description": "write it", "device": None,
                        "args": {"file_path": "/tmp/x/hello.txt", "content": "hello"}}], "answer": None}


class Server:
    """An HTTP server on 127.0.0.1 whose POST /v1/chat/completions calls `handler(body, writer)`."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[dict[str, Any]] = []
        self._server: asyncio.Server | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"

    def settings(self, **overrides: Any) -> LLMSettings:
        return LLMSettings(**{"base_url": self.base_url, "model": "smollm2", "max_retries": 0, "timeout": 10,
                              **overrides})

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.decode("latin-1").split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            body = json.loads(await reader.readexactly(length))
            self.requests.append(body)
            await self.handler(body, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 1)


async def respond(writer: asyncio.StreamWriter, status: int, payload: Any, content_type: str = "application/json"
                  ) -> None:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(data)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + data)
    await writer.drain()


def completion(text: str, finish: str = "stop") -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()), "model": "smollm2",
            "choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": max(1, len(text) // 4),
                      "total_tokens": 10 + max(1, len(text) // 4)}}


def devices() -> dict[str, DeviceView]:
    return {"laptop": DeviceView(tools=files_toolset().infos())}


@contextlib.asynccontextmanager
async def client(server: Server, **overrides: Any) -> AsyncIterator[LLMClient]:
    llm = LLMClient(server.settings(**overrides))
    try:
        yield llm
    finally:
        await llm.close()


# -- a server that refuses json_schema with a 500 ----------------------------------------------------


async def llama_cpp_like(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
    """llama-cpp-python: a `json_schema` response format ends in a bare 500; `json_object` works."""
    if (body.get("response_format") or {}).get("type") == "json_schema":
        await respond(writer, 500, b"Internal Server Error", "text/plain")
        return
    await respond(writer, 200, completion(json.dumps(GOOD_PLAN)))


async def test_a_500_on_json_schema_falls_back_and_the_working_mode_is_remembered() -> None:
    async with Server(llama_cpp_like) as server, client(server) as llm:
        first = await plan_request(llm, "write hello", devices=devices())
        assert [s.skill for s in first.plan.steps] == ["write_file"] and first.llm_calls == 2
        assert llm.json_schema_supported is False and llm.output_mode_used == "json_object"
        second = await plan_request(llm, "write hello again", devices=devices())
    assert second.llm_calls == 1  # straight to the mode that worked: no second refusal
    kinds = [(r.get("response_format") or {}).get("type") for r in server.requests]
    assert kinds == ["json_schema", "json_object", "json_object"]
    assert all(isinstance(r.get("max_tokens"), int) and r["max_tokens"] > 0 for r in server.requests)
    # where the server does not enforce the schema, the prompt states the short one (the skills' arguments
    # are in the prompt already), not the per-skill strict one
    system = server.requests[1]["messages"][0]["content"]
    assert '"steps"' in system and '"anyOf"' not in system


async def test_a_refusal_that_names_the_format_falls_back_even_after_the_mode_worked() -> None:
    calls = {"n": 0}

    async def flaky(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        calls["n"] += 1
        if (body.get("response_format") or {}).get("type") == "json_object" and calls["n"] > 1:
            await respond(writer, 503, {"error": {"message": "response_format json_object: grammar failed"}})
            return
        await respond(writer, 200, completion('{"a": 1}'))

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    async with Server(flaky) as server, client(server, output_mode="json_object") as llm:
        assert (await llm.complete([{"role": "user", "content": "x"}], json_schema=schema)).response_format \
            == "json_object"
        again = await llm.complete([{"role": "user", "content": "x"}], json_schema=schema)
    assert again.response_format == "grammar" and again.fell_back and again.calls == 2
    grammar = server.requests[-1]["grammar"]
    assert grammar.startswith("root ::= ") and '"\\"a\\""' in grammar
    assert "response_format" not in server.requests[-1]


@pytest.mark.parametrize("mode", ["json_schema", "json_object", "grammar", "tools", "plain"])
async def test_each_output_mode_asks_its_way_and_reads_the_reply(mode: str) -> None:
    async def answer(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        if body.get("tools"):
            reply = completion("")
            reply["choices"][0]["message"]["tool_calls"] = [{"id": "c1", "type": "function", "function": {
                "name": body["tools"][0]["function"]["name"], "arguments": json.dumps(GOOD_PLAN)}}]
            await respond(writer, 200, reply)
            return
        await respond(writer, 200, completion(json.dumps(GOOD_PLAN)))

    async with Server(answer) as server, client(server, output_mode=mode) as llm:
        result = await plan_request(llm, "write hello", devices=devices())
    assert result.plan.steps[0].skill == "write_file" and result.llm_calls == 1
    body = server.requests[0]
    assert body["max_tokens"] == 1024
    assert ("response_format" in body) == (mode in ("json_schema", "json_object"))
    assert ("grammar" in body) == (mode == "grammar") and ("tools" in body) == (mode == "tools")
    if mode == "json_schema":
        assert body["response_format"]["json_schema"]["strict"] is True


# -- the timeout is a wall-clock limit on the whole exchange -------------------------------------------


async def streams_forever(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "smollm2",
             "choices": [{"index": 0, "delta": {"content": "garbage "}, "finish_reason": None}]}
    while True:
        writer.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await writer.drain()
        await asyncio.sleep(0.01)


async def never_answers(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(3600)


@pytest.mark.parametrize(("handler", "stream"), [(streams_forever, True), (never_answers, False)])
async def test_the_timeout_bounds_the_whole_exchange(handler: Handler, stream: bool) -> None:
    loop = asyncio.get_running_loop()
    async with Server(handler) as server, client(server, timeout=1.0, max_retries=5) as llm:
        began = loop.time()
        with pytest.raises(LLMError, match=r"did not answer within 1 s"):
            await llm.complete([{"role": "user", "content": "plan"}], json_schema=GOOD_SCHEMA, stream=stream)
        took = loop.time() - began
    # unbounded, five retries of 1 s each would take 5 s or more: the slack is for a loaded machine's loop
    assert 1.0 <= took < 2.5, took
    assert server.requests and all("max_tokens" in r for r in server.requests)


async def test_retries_stay_inside_the_budget() -> None:
    async def overloaded(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await respond(writer, 503, {"error": {"message": "the server is busy"}})

    loop = asyncio.get_running_loop()
    async with Server(overloaded) as server, client(server, timeout=1.2, max_retries=10) as llm:
        began = loop.time()
        with pytest.raises(LLMError):
            await llm.complete([{"role": "user", "content": "hi"}])
        took = loop.time() - began
    # waits of 0.5 s, 1 s, 2 s … cut at the budget (uncut: 3.5 s and more); the slack is for a loaded machine
    assert took < 2.6 and 2 <= len(server.requests) <= 4


# -- a runaway reply is not pasted back ----------------------------------------------------------------


async def test_a_runaway_reply_is_quoted_only_by_its_prefix_in_the_re_ask() -> None:
    garbage = "<|im_start|>" + "placeholder " * 2000  # 24 kB, cut off at max_tokens

    async def runaway(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await respond(writer, 200, completion(garbage, finish="length"))

    async with Server(runaway) as server, client(server, output_mode="json_object", max_tokens=300) as llm:
        with pytest.raises(PlanningError):
            await plan_request(llm, "write hello", devices=devices())
    assert len(server.requests) == 2 and all(r["max_tokens"] == 300 for r in server.requests)
    re_ask = server.requests[1]["messages"]
    quoted = re_ask[-2]
    assert quoted["role"] == "assistant" and len(quoted["content"]) <= 600
    assert quoted["content"].startswith("<|im_start|>placeholder")
    note = re_ask[-1]["content"]
    assert "cut off" in note and "300" in note
    assert len(json.dumps(server.requests[1])) < len(json.dumps(server.requests[0])) + 3000


# -- the strict plan schema --------------------------------------------------------------------------


GOOD_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
               "additionalProperties": False}


def _strict_ok(schema: Any, depth: int = 0) -> None:
    """OpenAI's strict rules: objects list every property as required and forbid others; no oneOf."""
    if isinstance(schema, dict):
        assert "oneOf" not in schema and "allOf" not in schema and "default" not in schema
        if schema.get("type") == "object" or (isinstance(schema.get("type"), list) and "object" in schema["type"]):
            assert schema.get("additionalProperties") is False, schema
            assert sorted(schema.get("required", [])) == sorted(schema.get("properties", {})), schema
        for value in schema.values():
            _strict_ok(value, depth + 1)
    elif isinstance(schema, list):
        for value in schema:
            _strict_ok(value, depth + 1)


def test_the_plan_schema_names_each_skill_with_its_own_arguments() -> None:
    views = devices()
    schema, strict = plan_schema(views)
    assert strict
    _strict_ok(schema)
    branches = schema["properties"]["steps"]["items"]["anyOf"]
    by_skill = {b["properties"]["skill"]["enum"][0]: b for b in branches}
    assert {"write_file", "read_file", "observe"} <= set(by_skill)
    write = by_skill["write_file"]["properties"]["args"]
    assert {"file_path", "content"} <= set(write["properties"])
    schema_to_gbnf(schema)  # and the same schema is a grammar for llama.cpp


async def test_a_server_failing_every_way_is_an_error_and_poisons_no_mode() -> None:
    async def broken(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await respond(writer, 500, {"error": {"message": "out of memory"}})

    async with Server(broken) as server, client(server) as llm:
        with pytest.raises(LLMError, match="HTTP 500: out of memory"):
            await llm.complete([{"role": "user", "content": "x"}], json_schema=GOOD_SCHEMA)
        assert llm.json_schema_supported is None and llm.output_mode_used == "json_schema"
    assert len(server.requests) == 5  # each mode once, then the error


def test_strict_form_of_tool_schemas() -> None:
    from tether.agent.planning.schema import strict_schema

    given = {"type": "object", "properties": {
        "path": {"type": "string", "minLength": 1}, "limit": {"type": "integer", "default": 10},
        "mode": {"enum": ["a", "b"]}, "env": {"type": "object", "additionalProperties": {"type": "string"}}},
        "required": ["path"]}
    strict = strict_schema(given)
    assert strict == {"type": "object", "additionalProperties": False, "required": ["path", "limit", "mode"],
                      "properties": {"path": {"type": "string"}, "limit": {"type": ["integer", "null"]},
                                     "mode": {"enum": ["a", "b", None]}}}  # a free-form optional map left out
    assert strict_schema({**given, "required": ["env"]}) is None  # a required one cannot be left out


async def test_null_optional_arguments_of_a_strict_reply_are_dropped() -> None:
    plan = {"steps": [{"skill": "read_file", "description": "read", "device": None,
                       "args": {"file_path": "/tmp/x", "encoding": None, "max_bytes": None, "offset": None}}],
            "answer": None}

    async def answer(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        await respond(writer, 200, completion(json.dumps(plan)))

    async with Server(answer) as server, client(server) as llm:
        result = await plan_request(llm, "read it", devices=devices())
    assert result.plan.steps[0].args == {"file_path": "/tmp/x"}


def test_a_free_form_required_argument_makes_the_schema_not_strict() -> None:
    from tether.protocol.models import ToolInfo

    free = ToolInfo(name="ext.call", namespace="ext", tool_type="action", description="x", input_schema={
        "type": "object", "properties": {"payload": {"type": "object"}}, "required": ["payload"]})
    schema, strict = plan_schema({"a": DeviceView(tools=[free]), "b": DeviceView(tools=files_toolset().infos())})
    assert not strict
    branches = {b["properties"]["skill"]["enum"][0]: b for b in schema["properties"]["steps"]["items"]["anyOf"]}
    assert branches["ext.call"]["properties"]["args"] == {"type": "object"}
    assert branches["ext.call"]["properties"]["device"]["enum"] == ["a", None]


def test_grammar_of_an_object_with_only_optional_keys() -> None:
    grammar = schema_to_gbnf({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}})
    assert grammar.startswith("root ::= ") and '"\\"a\\""' in grammar and '"\\"b\\""' in grammar
    with pytest.raises(ValueError):
        schema_to_gbnf({"$ref": "#/$defs/x"})


def test_a_chain_schema_and_prompt_leave_out_the_graph_keys_and_ids_have_their_form() -> None:
    chain, _ = plan_schema(devices(), graph=False)
    branch = chain["properties"]["steps"]["items"]["anyOf"][0]
    assert set(branch["required"]) == {"skill", "args", "description", "device"}
    graph, _ = plan_schema(devices())
    keys = graph["properties"]["steps"]["items"]["anyOf"][0]["properties"]
    # a grammar-enforcing server cannot let a model run on inside an id (SmolLM2 wrote 100 digits until max_tokens)
    assert keys["id"]["pattern"] == keys["needs"]["items"]["pattern"] == ID_PATTERN.pattern
    system = build_messages("x", devices(), "none", graph=False)[0]["content"]
    assert '"needs"' not in system and "as a graph" not in system


def test_a_reply_cut_off_inside_a_step_is_not_read_as_its_inner_list() -> None:
    cut = '{"steps": [{"skill": "write_file", "args": {"file_path": "a"}, "needs": ["x", "y"], "description": "wri'
    with pytest.raises(PlanError, match="not a JSON plan"):
        parse_plan_reply(cut)
