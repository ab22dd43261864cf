"""The LLM client through the real `openai` SDK against a real Chat Completions server on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from bench.kit.fake_llm import FakeLLM, HTTPFailure, closed_port, prompt_tokens_of
from tether.agent.llm.chat import LLMClient, LLMError
from tether.agent.llm.settings import LLMSettings, how_to_configure, resolve_llm_settings

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to the world."}]
SCHEMA = {"type": "object", "properties": {"greeting": {"type": "string"}}, "required": ["greeting"]}


async def test_plain_completion_counts_tokens() -> None:
    async with FakeLLM(["hello, world"]) as fake, LLMClient(fake.settings()) as client:
        reply = await client.complete(MESSAGES)
    assert reply.text == "hello, world"
    assert reply.prompt_tokens == prompt_tokens_of(fake.requests[0]) > 0
    assert reply.completion_tokens == len("hello, world") // 4
    assert reply.calls == 1 and reply.response_format == "text" and not reply.usage_estimated
    assert client.calls == 1 and client.prompt_tokens == reply.prompt_tokens
    body = fake.requests[0]
    assert body["model"] == "fake-model" and body["messages"] == MESSAGES
    assert body["temperature"] == 0 and "response_format" not in body


async def test_counters_accumulate_over_calls() -> None:
    async with FakeLLM(["one", "two"]) as fake, LLMClient(fake.settings()) as client:
        first = await client.complete(MESSAGES)
        second = await client.complete(MESSAGES)
    assert client.calls == 2
    assert client.prompt_tokens == first.prompt_tokens + second.prompt_tokens


async def test_streaming_delivers_chunks_and_usage() -> None:
    text = "a streamed reply that spans several chunks"
    tokens: list[str] = []
    async with FakeLLM([text], chunk_size=5) as fake, LLMClient(fake.settings()) as client:
        reply = await client.complete(MESSAGES, stream=True, on_token=tokens.append)
    assert reply.text == text
    assert len(tokens) > 1 and "".join(tokens) == text
    body = fake.requests[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert reply.prompt_tokens == prompt_tokens_of(body) and not reply.usage_estimated
    assert reply.completion_tokens == len(text) // 4


async def test_json_schema_is_sent() -> None:
    async with FakeLLM(['{"greeting": "hi"}']) as fake, LLMClient(fake.settings()) as client:
        reply = await client.complete(MESSAGES, json_schema=SCHEMA, schema_name="greeting")
    assert json.loads(reply.text) == {"greeting": "hi"}
    assert reply.response_format == "json_schema" and client.json_schema_supported is True
    fmt = fake.requests[0]["response_format"]
    assert fmt == {"type": "json_schema", "json_schema": {"name": "greeting", "schema": SCHEMA, "strict": False}}


async def test_json_schema_rejected_falls_back_to_json_object() -> None:
    replies = ['{"greeting": "hi"}', '{"greeting": "again"}']
    async with FakeLLM(replies, reject_json_schema=True) as fake, LLMClient(fake.settings()) as client:
        reply = await client.complete(MESSAGES, json_schema=SCHEMA)
        assert reply.fell_back_to_json_object and reply.calls == 2
        assert reply.response_format == "json_object"
        assert client.json_schema_supported is False and client.fallbacks == 1
        # later calls go straight to JSON mode: no second rejection
        again = await client.complete(MESSAGES, json_schema=SCHEMA)
    assert json.loads(again.text) == {"greeting": "again"} and again.calls == 1
    assert len(fake.rejected) == 1
    assert [r["response_format"] for r in fake.requests] == [{"type": "json_object"}] * 2
    # the schema the server no longer enforces is stated in the system prompt instead
    system = fake.requests[0]["messages"][0]
    assert system["role"] == "system" and '"greeting"' in system["content"]
    assert client.calls == 3  # the rejected call counts too


async def test_server_error_becomes_clear_llm_error() -> None:
    async with FakeLLM([HTTPFailure(500, "the model crashed")]) as fake, LLMClient(fake.settings()) as client:
        with pytest.raises(LLMError) as info:
            await client.complete(MESSAGES)
    message = str(info.value)
    assert "HTTP 500" in message and "the model crashed" in message and fake.base_url in message


async def test_bad_request_without_schema_is_an_error_not_a_fallback() -> None:
    async with FakeLLM([HTTPFailure(400, "context too long")]) as fake, LLMClient(fake.settings()) as client:
        with pytest.raises(LLMError, match="HTTP 400: context too long"):
            await client.complete(MESSAGES)


async def test_connection_refused_says_cannot_reach() -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    async with LLMClient(LLMSettings(base_url=url, model="m", max_retries=0, timeout=5)) as client:
        with pytest.raises(LLMError) as info:
            await client.complete(MESSAGES)
    assert f"cannot reach the LLM at {url}" in str(info.value)


def test_from_env_none_without_config() -> None:
    assert LLMSettings.from_env({}) is None
    assert LLMSettings.from_env({"TETHER_LLM_BASE_URL": "http://127.0.0.1:11434/v1"}) is None
    assert LLMSettings.from_env({"TETHER_LLM_MODEL": "llama3.1", "OPENAI_API_KEY": "sk"}) is None


def test_from_env_reads_settings_and_key_fallback() -> None:
    settings = LLMSettings.from_env({"TETHER_LLM_BASE_URL": "http://127.0.0.1:11434/v1",
                                     "TETHER_LLM_MODEL": "llama3.1", "OPENAI_API_KEY": "sk-openai"})
    assert settings is not None
    assert (settings.base_url, settings.model, settings.api_key) == ("http://127.0.0.1:11434/v1", "llama3.1",
                                                                   "sk-openai")
    assert (settings.timeout, settings.max_retries, settings.temperature) == (60, 1, 0)
    own = LLMSettings.from_env({"TETHER_LLM_BASE_URL": "u", "TETHER_LLM_MODEL": "m",
                                "TETHER_LLM_API_KEY": "mine", "OPENAI_API_KEY": "theirs"})
    assert own is not None and own.api_key == "mine"
    assert "mine" not in repr(own)


def test_how_to_configure_names_everything() -> None:
    text = how_to_configure()
    for needle in ("TETHER_LLM_BASE_URL=http://127.0.0.1:11434/v1", "TETHER_LLM_MODEL=llama3.1",
                   "TETHER_LLM_API_KEY", "OPENAI_API_KEY", "tether run --plan plan.yaml", "Ollama"):
        assert needle in text


def test_settings_from_the_config_file_and_env_precedence(tmp_path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("llm:\n  base_url: http://127.0.0.1:9/v1\n  model: m1\n  api_key_env: MY_KEY\n")
    env = {"TETHER_CONFIG": str(config), "MY_KEY": "k-123"}
    settings = resolve_llm_settings(env=env)
    assert settings is not None and (settings.base_url, settings.model, settings.api_key) == \
        ("http://127.0.0.1:9/v1", "m1", "k-123")
    # the environment wins over the file
    env_wins = resolve_llm_settings(env={**env, "TETHER_LLM_BASE_URL": "http://h/v1", "TETHER_LLM_MODEL": "m2"})
    assert env_wins is not None and env_wins.model == "m2"
    # nothing configured anywhere: None, and the advice names the file
    assert resolve_llm_settings(env={"XDG_CONFIG_HOME": str(tmp_path / "empty")}) is None
    # but a file named on purpose that does not exist is an error, never silently ignored (issue 12)
    with pytest.raises(ValueError, match=r"TETHER_CONFIG names .*absent\.yaml"):
        resolve_llm_settings(env={"TETHER_CONFIG": str(tmp_path / "absent.yaml")})
    assert "llm:" in how_to_configure()


@pytest.mark.parametrize(("text", "needle"), [
    ("llm:\n  model: m\n", "base_url"),
    ("llm:\n  base_url: u\n  model: m\n  colour: red\n", "colour"),
    ("llm:\n  base_url: u\n  model: m\n  api_key_env: UNSET_VAR_X\n", "UNSET_VAR_X"),
    ("- a list\n", "mapping"),
    ("llm: [unclosed\n", "is not valid YAML: line 2, column 1"),
])
def test_broken_config_file_names_the_file_and_the_problem(tmp_path, text: str, needle: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    with pytest.raises(ValueError) as err:
        resolve_llm_settings(env={"TETHER_CONFIG": str(config)})
    assert str(config) in str(err.value) and needle in str(err.value)
