"""The LLM client: any OpenAI-compatible Chat Completions endpoint through the official `openai` SDK.

One client serves OpenAI, Azure, Ollama, vLLM, llama.cpp and LM Studio. It counts calls and tokens
(for the benchmark), asks for JSON under a schema when told to (falling back to plain JSON mode when
the server rejects `json_schema`), streams when asked, and turns every transport or HTTP failure
into an `LLMError` whose message says what went wrong and where.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tether.errors import AgentError

ENV_BASE_URL = "TETHER_LLM_BASE_URL"
ENV_MODEL = "TETHER_LLM_MODEL"
ENV_API_KEY = "TETHER_LLM_API_KEY"
ENV_OPENAI_API_KEY = "OPENAI_API_KEY"
ENV_CONFIG = "TETHER_CONFIG"

# Local servers (Ollama, llama.cpp, vLLM) need no key, but the SDK insists on one.
NO_API_KEY = "not-needed"

Message = dict[str, Any]
ResponseFormatUsed = Literal["text", "json_schema", "json_object"]


class LLMError(AgentError, RuntimeError):
    """The LLM could not be asked or did not answer; the message says why and where."""


class LLMSettings(BaseModel):
    """Where the LLM is and how to call it."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(..., min_length=1)
    model: str = Field(..., min_length=1)
    api_key: str | None = Field(default=None, repr=False)
    timeout: float = Field(default=60.0, gt=0)
    max_retries: int = Field(default=1, ge=0)
    temperature: float = Field(default=0.0, ge=0)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LLMSettings | None:
        """Settings from `TETHER_LLM_*` (key also from `OPENAI_API_KEY`); None when not configured."""
        env = os.environ if env is None else env
        base_url = (env.get(ENV_BASE_URL) or "").strip()
        model = (env.get(ENV_MODEL) or "").strip()
        if not base_url or not model:
            return None
        api_key = (env.get(ENV_API_KEY) or env.get(ENV_OPENAI_API_KEY) or "").strip() or None
        return cls(base_url=base_url, model=model, api_key=api_key)


def default_config_path(env: Mapping[str, str] | None = None) -> Path:
    """$TETHER_CONFIG, else $XDG_CONFIG_HOME/tether/config.yaml (~/.config/tether/config.yaml)."""
    env = os.environ if env is None else env
    if env.get(ENV_CONFIG):
        return Path(env[ENV_CONFIG]).expanduser()
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "tether" / "config.yaml"


class _LLMSection(LLMSettings):
    """The config file's `llm:` section: the settings, plus the name of a variable holding the key
    (better than the key itself in a file)."""

    api_key_env: str | None = None


def resolve_llm_settings(path: str | os.PathLike[str] | None = None,
                         env: Mapping[str, str] | None = None) -> LLMSettings | None:
    """The LLM to use: `TETHER_LLM_*` in the environment win, else the `llm:` section of the config
    file (`path`, or `default_config_path()`), else None. A broken file is an error naming it."""
    env = os.environ if env is None else env
    from_env = LLMSettings.from_env(env)
    if from_env is not None:
        return from_env
    file = Path(path).expanduser() if path is not None else default_config_path(env)
    if not file.is_file():
        if path is not None:
            raise ValueError(f"config file {file} does not exist")
        if env.get(ENV_CONFIG):  # named on purpose: never silently ignored
            raise ValueError(f"{ENV_CONFIG} names {file}, which does not exist (unset it to use no config file)")
        return None
    import yaml  # only with a config file: a server without one does not import it

    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read config file {file}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {file} must be a mapping with an 'llm:' section")
    if data.get("llm") is None:
        return None
    try:
        section = _LLMSection.model_validate(data["llm"])
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'llm'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{file}: llm: {problems}") from None
    key = section.api_key
    if section.api_key_env:
        key = env.get(section.api_key_env) or None
        if key is None:
            raise ValueError(f"{file}: llm.api_key_env names {section.api_key_env}, which is not set")
    values = section.model_dump(exclude={"api_key", "api_key_env"})
    return LLMSettings(**values, api_key=key or env.get(ENV_API_KEY) or env.get(ENV_OPENAI_API_KEY) or None)


def how_to_configure() -> str:
    """What to tell a person who asked for planning with no LLM configured."""
    return (
        "No LLM is configured, so tether cannot plan a request written in plain words.\n"
        "Point tether at any OpenAI-compatible endpoint with these environment variables:\n"
        f"  {ENV_BASE_URL}   the endpoint's base URL (ending in /v1)\n"
        f"  {ENV_MODEL}      the model name\n"
        f"  {ENV_API_KEY}    the API key, if the endpoint needs one (or {ENV_OPENAI_API_KEY})\n"
        "\n"
        "For example, a local Ollama (https://ollama.com):\n"
        "  ollama pull llama3.1\n"
        f"  export {ENV_BASE_URL}=http://127.0.0.1:11434/v1\n"
        f"  export {ENV_MODEL}=llama3.1\n"
        "\n"
        "or OpenAI:\n"
        f"  export {ENV_BASE_URL}=https://api.openai.com/v1\n"
        f"  export {ENV_MODEL}=gpt-4o-mini\n"
        f"  export {ENV_OPENAI_API_KEY}=sk-...\n"
        "\n"
        f"or the same in the config file ({default_config_path()} or ${ENV_CONFIG}):\n"
        "  llm:\n"
        "    base_url: http://127.0.0.1:11434/v1\n"
        "    model: llama3.1\n"
        "    api_key_env: OPENAI_API_KEY     # optional: the variable holding the key\n"
        "\n"
        "Without any LLM, `tether run --plan plan.yaml` runs a plan written by hand\n"
        "(a list of steps: skill, args, description, device) with the same execution and recovery."
    )


class LLMReply(BaseModel):
    """One answer: its text, the tokens it cost, and how many HTTP calls it took."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: int = 1
    response_format: ResponseFormatUsed = "text"
    fell_back_to_json_object: bool = False
    usage_estimated: bool = False


def estimate_tokens(text: str) -> int:
    """A crude count (4 characters a token) for servers that report no usage."""
    return max(1, len(text) // 4) if text else 0


def _messages_text(messages: list[Message]) -> str:
    parts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif content is not None:
            parts.append(json.dumps(content))
    return "\n".join(parts)


def _with_schema_instruction(messages: list[Message], json_schema: dict[str, Any]) -> list[Message]:
    """In JSON-object mode the server no longer enforces the schema, so the prompt must state it."""
    note = ("Reply with one JSON object only, no prose, matching this JSON schema:\n"
            + json.dumps(json_schema, separators=(",", ":")))
    out = [dict(m) for m in messages]
    for message in out:
        if message.get("role") == "system" and isinstance(message.get("content"), str):
            message["content"] = f"{message['content']}\n\n{note}"
            return out
    return [{"role": "system", "content": note}, *out]


class LLMClient:
    """An async Chat Completions client with call and token counters.

    `json_schema_supported` starts unknown (None); after a server rejects `json_schema` it is False
    and later calls use `{"type": "json_object"}` straight away.
    """

    def __init__(self, settings: LLMSettings) -> None:
        from openai import AsyncOpenAI  # the SDK is heavy; only a configured LLM pays for it

        self.settings = settings
        self._client = AsyncOpenAI(
            base_url=settings.base_url,
            api_key=settings.api_key or NO_API_KEY,
            timeout=settings.timeout,
            max_retries=settings.max_retries,
        )
        self.calls = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.json_schema_supported: bool | None = None
        self.fallbacks = 0

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> LLMClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def reset_counters(self) -> None:
        self.calls = self.prompt_tokens = self.completion_tokens = 0

    async def complete(self, messages: list[Message], *, json_schema: dict[str, Any] | None = None,
                       schema_name: str = "reply", stream: bool = False,
                       on_token: Callable[[str], None] | None = None) -> LLMReply:
        """Ask once (twice when the server rejects `json_schema` and JSON mode is tried instead)."""
        import openai

        if json_schema is None:
            return await self._ask(messages, None, "text", stream, on_token)
        if self.json_schema_supported is not False:
            response_format = {"type": "json_schema",
                               "json_schema": {"name": schema_name, "schema": json_schema, "strict": False}}
            try:
                reply = await self._ask(messages, response_format, "json_schema", stream, on_token,
                                        raise_bad_request=True)
            except openai.BadRequestError:
                self.json_schema_supported = False
                self.fallbacks += 1
            else:
                self.json_schema_supported = True
                return reply
            reply = await self._ask(_with_schema_instruction(messages, json_schema), {"type": "json_object"},
                                    "json_object", stream, on_token)
            return reply.model_copy(update={"calls": 2, "fell_back_to_json_object": True})
        return await self._ask(_with_schema_instruction(messages, json_schema), {"type": "json_object"},
                               "json_object", stream, on_token)

    async def _ask(self, messages: list[Message], response_format: dict[str, Any] | None,
                   used: ResponseFormatUsed, stream: bool, on_token: Callable[[str], None] | None,
                   *, raise_bad_request: bool = False) -> LLMReply:
        import openai

        kwargs: dict[str, Any] = {"model": self.settings.model, "messages": messages,
                                  "temperature": self.settings.temperature}
        if response_format is not None:
            kwargs["response_format"] = response_format
        self.calls += 1
        try:
            if stream:
                text, usage = await self._stream(kwargs, on_token)
            else:
                response = await self._client.chat.completions.create(**kwargs)
                choice = response.choices[0] if response.choices else None
                text = (choice.message.content if choice is not None else None) or ""
                usage = response.usage
        except openai.BadRequestError as exc:
            if raise_bad_request:
                raise
            raise self._error(exc) from exc
        except openai.OpenAIError as exc:
            raise self._error(exc) from exc
        estimated = usage is None
        prompt_tokens = usage.prompt_tokens if usage is not None else estimate_tokens(_messages_text(messages))
        completion_tokens = usage.completion_tokens if usage is not None else estimate_tokens(text)
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        return LLMReply(text=text, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                        response_format=used, usage_estimated=estimated)

    async def _stream(self, kwargs: dict[str, Any], on_token: Callable[[str], None] | None) -> tuple[str, Any]:
        chunks: list[str] = []
        usage = None
        response = await self._client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True})
        async with response:
            async for chunk in response:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices or ():
                    piece = choice.delta.content if choice.delta is not None else None
                    if piece:
                        chunks.append(piece)
                        if on_token is not None:
                            on_token(piece)
        return "".join(chunks), usage

    def _error(self, exc: BaseException) -> LLMError:
        import openai

        where = f"the LLM at {self.settings.base_url}"
        if isinstance(exc, openai.APITimeoutError):
            return LLMError(f"{where} did not answer within {self.settings.timeout:g} s "
                            f"(model {self.settings.model})")
        if isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__ or exc.__context__
            detail = f": {cause}" if cause is not None else ""
            return LLMError(f"cannot reach the LLM at {self.settings.base_url}{detail}")
        if isinstance(exc, openai.APIStatusError):
            message = _status_message(exc)
            hint = ""
            if isinstance(exc, openai.AuthenticationError):
                hint = f" (check {ENV_API_KEY} or {ENV_OPENAI_API_KEY})"
            elif isinstance(exc, openai.NotFoundError):
                hint = f" (check the model name {self.settings.model!r} and that the base URL ends in /v1)"
            return LLMError(f"{where} returned HTTP {exc.status_code}: {message}{hint}")
        return LLMError(f"{where} failed: {exc}")


def _status_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return str(getattr(exc, "message", "") or exc)
