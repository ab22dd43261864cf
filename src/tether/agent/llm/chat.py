"""The LLM client: any OpenAI-compatible Chat Completions endpoint through the official `openai` SDK.

One client serves OpenAI, Azure, Ollama, vLLM, llama.cpp and LM Studio. It counts calls and tokens
(for the benchmark), asks for JSON under a schema when told to (in the configured output mode, falling
back along `MODES` when a server refuses one), always bounds the reply (`max_tokens`) and the whole
exchange (`timeout`, retries included), streams when asked, and turns every transport or HTTP failure
into an `LLMError` whose message says what went wrong and where.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel

from tether.agent.llm.settings import ENV_API_KEY, ENV_OPENAI_API_KEY, LLMSettings
from tether.errors import AgentError

# Local servers (Ollama, llama.cpp, vLLM) need no key, but the SDK insists on one.
NO_API_KEY = "not-needed"

Message = dict[str, Any]
ResponseFormatUsed = Literal["text", "json_schema", "json_object", "grammar", "tools", "plain"]
MODES: tuple[ResponseFormatUsed, ...] = ("json_schema", "json_object", "grammar", "tools", "plain")
# words in an error that say the server refused the way the output was asked for
_FORMAT_WORDS = ("response_format", "response format", "json_schema", "json_object", "grammar", "format",
                 "schema")
_TOOL_WORDS = ("tool", "function")
_REFUSED_FIRST_TRY = (400, 422, 500)
_PASSING_STATUS = (408, 409, 429, 500, 502, 503, 504)


class LLMError(AgentError, RuntimeError):
    """The LLM could not be asked or did not answer; the message says why and where."""


class LLMReply(BaseModel):
    """One answer: its text, the tokens it cost, how many HTTP calls it took and how it was asked.

    `response_format` is the output mode that produced it ("text" for a call without a schema);
    `finish_reason` is the server's ("length": cut off at `max_tokens`)."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: int = 1
    response_format: ResponseFormatUsed = "text"
    fell_back_to_json_object: bool = False
    fell_back: bool = False
    usage_estimated: bool = False
    finish_reason: str | None = None

    @property
    def truncated(self) -> bool:
        """True when the server stopped the reply at `max_tokens`."""
        return self.finish_reason == "length"


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


class _Refused(AgentError):
    """The server refused the output mode of this call (the next mode may work)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class LLMClient:
    """An async Chat Completions client with call and token counters.

    Structured calls (`json_schema` given) use the configured output mode, falling back along `MODES`
    when the server refuses one; the modes refused and the one that worked are remembered for the
    client's life, so later calls go straight to the working mode. `json_schema_supported` is None
    until the server has accepted or refused `json_schema`. The SDK never retries on its own: the
    client's own bounded retries run inside `settings.timeout`, a wall-clock limit on each `complete`.
    """

    def __init__(self, settings: LLMSettings) -> None:
        from openai import AsyncOpenAI  # the SDK is heavy; only a configured LLM pays for it

        self.settings = settings
        self._client = AsyncOpenAI(
            base_url=settings.base_url,
            api_key=settings.api_key or NO_API_KEY,
            timeout=settings.timeout + 5,  # the exchange's own limit (asyncio.timeout) comes first
            max_retries=0,
        )
        self.calls = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.fallbacks = 0
        self.retries = 0
        self._refused: set[str] = set()
        self._worked: set[str] = set()

    @property
    def json_schema_supported(self) -> bool | None:
        """True once the server answered in `json_schema` mode, False once it refused it, else None."""
        if "json_schema" in self._worked:
            return True
        return False if "json_schema" in self._refused else None

    @property
    def output_mode_used(self) -> ResponseFormatUsed | None:
        """The mode structured calls start with now: the first of the configured order not refused."""
        modes = self._modes()
        return modes[0] if modes else None

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> LLMClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def reset_counters(self) -> None:
        self.calls = self.prompt_tokens = self.completion_tokens = 0

    def _modes(self) -> list[ResponseFormatUsed]:
        configured = self.settings.output_mode
        order = list(MODES) if configured == "auto" else list(MODES[MODES.index(configured):])
        return [m for m in order if m not in self._refused] or ["plain"]

    async def complete(self, messages: list[Message], *, json_schema: dict[str, Any] | None = None,
                       schema_name: str = "reply", strict: bool = False, stream: bool = False,
                       on_token: Callable[[str], None] | None = None, max_tokens: int | None = None,
                       prompt_schema: dict[str, Any] | None = None) -> LLMReply:
        """Ask once: the reply's text (JSON under `json_schema` when one is given).

        `strict` asks `json_schema` mode for OpenAI's strict form (the schema must then follow its
        rules: every property required, `additionalProperties: false`). In every mode but `json_schema`
        the system prompt states `prompt_schema` (default: `json_schema`; a shorter form when the
        prompt already carries the details). `max_tokens` bounds the reply (default
        `settings.max_tokens`). The whole exchange — retries and fallbacks included — ends
        within `settings.timeout` seconds. Raises `LLMError` when no answer came."""
        limit = max_tokens if max_tokens is not None else self.settings.max_tokens
        start = self.calls
        try:
            async with asyncio.timeout(self.settings.timeout):
                reply = await self._exchange(messages, json_schema, schema_name, strict, stream, on_token, limit,
                                             prompt_schema)
        except TimeoutError:
            raise LLMError(f"the LLM at {self.settings.base_url} did not answer within {self.settings.timeout:g} s "
                           f"(model {self.settings.model}; {self.calls - start} call(s), retries included)") from None
        return reply.model_copy(update={"calls": self.calls - start})

    async def _exchange(self, messages: list[Message], json_schema: dict[str, Any] | None, schema_name: str,
                        strict: bool, stream: bool, on_token: Callable[[str], None] | None,
                        max_tokens: int, prompt_schema: dict[str, Any] | None) -> LLMReply:
        if json_schema is None:
            try:
                return await self._with_retries(messages, "text", {}, stream, on_token, max_tokens)
            except _Refused as refusal:  # pragma: no cover - "text" is never refused
                raise self._error(refusal.error) from refusal.error
        refused: list[tuple[ResponseFormatUsed, bool]] = []  # (mode, whether the error named the format)
        last: BaseException | None = None
        for mode in self._modes():
            try:
                request = self._request(mode, messages, json_schema, schema_name, strict, prompt_schema)
            except ValueError:  # the schema cannot be put this way (e.g. as a grammar)
                continue
            try:
                reply = await self._with_retries(request.pop("messages"), mode, request, stream, on_token,
                                                 max_tokens)
            except _Refused as refusal:
                refused.append((mode, self._names_format(refusal.error, mode)))
                self.fallbacks += 1
                last = refusal.error
                continue
            self._refused.update(m for m, _ in refused)
            self._worked.add(mode)
            return reply.model_copy(update={"fell_back": bool(refused),
                                            "fell_back_to_json_object": bool(refused) and mode == "json_object"})
        # no mode worked: a server failing every way is failing, not refusing; only the refusals that
        # named the format are remembered
        self._refused.update(m for m, named in refused if named)
        if last is None:
            raise LLMError(f"no output mode left to ask the LLM at {self.settings.base_url} in")
        raise self._error(last) from last

    def _request(self, mode: ResponseFormatUsed, messages: list[Message], json_schema: dict[str, Any],
                 schema_name: str, strict: bool, prompt_schema: dict[str, Any] | None) -> dict[str, Any]:
        """The messages and extra arguments of one structured call in `mode`."""
        if mode == "json_schema":
            return {"messages": messages, "response_format": {
                "type": "json_schema", "json_schema": {"name": schema_name, "schema": json_schema, "strict": strict}}}
        instructed = _with_schema_instruction(messages, prompt_schema or json_schema)
        if mode == "json_object":
            return {"messages": instructed, "response_format": {"type": "json_object"}}
        if mode == "grammar":
            from tether.agent.llm.grammar import schema_to_gbnf

            return {"messages": instructed, "extra_body": {"grammar": schema_to_gbnf(json_schema)}}
        if mode == "tools":
            name = re.sub(r"[^A-Za-z0-9_-]", "_", schema_name)[:64] or "reply"
            function = {"name": name, "description": f"Give the {schema_name}.", "parameters": json_schema}
            return {"messages": instructed, "tools": [{"type": "function", "function": function}],
                    "tool_choice": {"type": "function", "function": {"name": name}}}
        return {"messages": instructed}

    async def _with_retries(self, messages: list[Message], mode: ResponseFormatUsed, extra: dict[str, Any],
                            stream: bool, on_token: Callable[[str], None] | None, max_tokens: int) -> LLMReply:
        """One call, retried (at most `settings.max_retries` times, waits doubling from 0.5 s) when it
        failed for a passing reason; `_Refused` when the server refused the mode."""
        import openai

        attempt = 0
        while True:
            try:
                return await self._ask(messages, mode, extra, stream, on_token, max_tokens)
            except openai.APIStatusError as exc:
                if mode != "text" and (self._names_format(exc, mode) or (
                        mode not in self._worked and exc.status_code in _REFUSED_FIRST_TRY)):
                    raise _Refused(exc) from exc
                if exc.status_code not in _PASSING_STATUS or attempt >= self.settings.max_retries:
                    raise self._error(exc) from exc
            except openai.APIConnectionError as exc:  # includes the SDK's own timeout
                if attempt >= self.settings.max_retries:
                    raise self._error(exc) from exc
            except openai.OpenAIError as exc:
                raise self._error(exc) from exc
            await asyncio.sleep(min(0.5 * 2 ** attempt, 8.0))
            attempt += 1
            self.retries += 1

    @staticmethod
    def _names_format(exc: Any, mode: str) -> bool:
        text = f"{_status_message(exc)} {getattr(exc, 'body', '')}".lower()
        words = _FORMAT_WORDS + (_TOOL_WORDS if mode == "tools" else ())
        return any(word in text for word in words)

    async def _ask(self, messages: list[Message], used: ResponseFormatUsed, extra: dict[str, Any], stream: bool,
                   on_token: Callable[[str], None] | None, max_tokens: int) -> LLMReply:
        kwargs: dict[str, Any] = {"model": self.settings.model, "messages": messages,
                                  "temperature": self.settings.temperature, "max_tokens": max_tokens, **extra}
        self.calls += 1
        if stream:
            text, usage, finish = await self._stream(kwargs, on_token)
        else:
            response = await self._client.chat.completions.create(**kwargs)
            choice = response.choices[0] if response.choices else None
            text, finish = "", None
            if choice is not None:
                finish = choice.finish_reason
                calls = choice.message.tool_calls or []
                function = getattr(calls[0], "function", None) if calls else None
                text = (function.arguments if function is not None else None) or choice.message.content or ""
            usage = response.usage
        estimated = usage is None
        prompt_tokens = usage.prompt_tokens if usage is not None else estimate_tokens(_messages_text(messages))
        completion_tokens = usage.completion_tokens if usage is not None else estimate_tokens(text)
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        return LLMReply(text=text, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                        response_format=used, usage_estimated=estimated, finish_reason=finish)

    async def _stream(self, kwargs: dict[str, Any], on_token: Callable[[str], None] | None
                      ) -> tuple[str, Any, str | None]:
        chunks: list[str] = []
        usage = None
        finish: str | None = None
        response = await self._client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True})
        async with response:
            async for chunk in response:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices or ():
                    finish = choice.finish_reason or finish
                    delta = choice.delta
                    if delta is None:
                        continue
                    pieces = [delta.content or ""]
                    pieces += [call.function.arguments or "" for call in delta.tool_calls or ()
                               if call.function is not None]
                    for piece in pieces:
                        if piece:
                            chunks.append(piece)
                            if on_token is not None:
                                on_token(piece)
        return "".join(chunks), usage, finish

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
