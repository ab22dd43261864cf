"""What the device offers the external MCP servers it hosts, beyond calling their tools.

An MCP server may, while one of its tools runs, report progress, ask the person a question
(elicitation), ask the client's LLM (sampling), ask which directories it may work in (roots) and send
log messages. The device is the MCP client, but the person and the LLM are elsewhere: at the terminal
of `tether exec`, behind a server, in a task. So the device only routes: progress becomes an event of
the running command (the channel shell output uses, so REST SSE, the CLI and task events get it
as they get output); a question goes to whatever `MCPClientHooks.elicit` the device was given (a
terminal prompt, an AIP round trip to the server); a sampling request to `MCPClientHooks.sample`,
and only if the policy allows it. Whatever is not there, or does not answer in time, is a decline:
a server is never left waiting.

The SDK calls these callbacks from the session's reader, not from the task that made the call, so
the call a request belongs to is found among the calls in flight on that server: with one in flight
it is that one; with several (a device serving several sessions at once) the request cannot be
attributed and is declined rather than shown to the wrong person.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tether.tools.context import ToolContext

if TYPE_CHECKING:
    import mcp_types
    from mcp.shared.dispatcher import ProgressFnT

# `mcp_types` is imported where a server's request is answered, never at import: this module's
# `MCPClientHooks` is on every device's start-up path, external servers or not.

logger = logging.getLogger(__name__)

DEFAULT_ELICIT_TIMEOUT = 300.0  # a person at a prompt; after that the server hears "cancel"
DEFAULT_SAMPLE_TIMEOUT = 120.0
MAX_QUESTION_CHARS = 4000
MAX_SCHEMA_CHARS = 16_000
MAX_SAMPLING_CALLS = 5  # per command: a server in a loop must not spend the whole LLM budget
MAX_SAMPLING_TOKENS = 4000  # per request, whatever the server asks for
MAX_SAMPLING_PROMPT_CHARS = 64_000  # what a server may send the LLM in one request
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "notice": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL, "alert": logging.CRITICAL,
           "emergency": logging.CRITICAL}

Action = Literal["accept", "decline", "cancel"]


@dataclass(frozen=True, slots=True)
class ElicitationRequest:
    """One question an MCP server asks during a call: `schema` is the JSON schema of the answer (flat,
    primitive properties, as MCP allows)."""

    id: str
    server: str
    call_id: str | None
    session_id: str | None
    message: str
    schema: dict[str, Any]

    def event(self) -> dict[str, Any]:
        return {"id": self.id, "server": self.server, "call_id": self.call_id, "message": self.message,
                "schema": self.schema}


@dataclass(frozen=True, slots=True)
class ElicitationAnswer:
    action: Action
    content: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """A server's request for an LLM completion, reduced to text messages."""

    server: str
    call_id: str | None
    messages: list[dict[str, str]]
    system_prompt: str | None
    max_tokens: int
    temperature: float | None


@dataclass(frozen=True, slots=True)
class SamplingReply:
    text: str
    model: str


Elicitor = Callable[[ElicitationRequest], Awaitable[ElicitationAnswer]]
Sampler = Callable[[SamplingRequest], Awaitable[SamplingReply]]


@dataclass(slots=True)
class MCPClientHooks:
    """Who answers for the device: set by whoever runs it (the CLI, the device's server link). Read
    when a session opens (sampling is declared only if `sample` is set) and at each request."""

    elicit: Elicitor | None = None
    sample: Sampler | None = None
    elicit_timeout: float = DEFAULT_ELICIT_TIMEOUT
    sample_timeout: float = DEFAULT_SAMPLE_TIMEOUT

    def next_id(self) -> str:
        """Unguessable: an answer is taken for whoever holds the id (and the approve scope)."""
        return "q" + uuid.uuid4().hex[:16]


def file_roots(ctx: ToolContext) -> list[mcp_types.Root]:
    """The policy's write and read roots as `file://` roots (write roots first; each path once)."""
    import mcp_types

    seen: set[str] = set()
    roots: list[mcp_types.Root] = []
    for kind, paths in (("write", ctx.policy.write_roots), ("read", ctx.policy.read_roots)):
        for raw in paths:
            path = Path(raw).expanduser().resolve()
            if str(path) in seen:
                continue
            seen.add(str(path))
            roots.append(mcp_types.Root(uri=path.as_uri(), name=f"{path} ({kind})"))
    return roots


class ServerClientCaps:
    """One external server's side of the client capabilities: the calls in flight on it and the
    callbacks its sessions are opened with."""

    def __init__(self, namespace: str, hooks: MCPClientHooks, context: Callable[[], ToolContext | None]) -> None:
        self.namespace = namespace
        self.hooks = hooks
        self._context = context
        self._calls: dict[int, ToolContext] = {}
        self._keys = itertools.count()
        self._sampled: dict[str | None, int] = {}
        self.server_log = logging.getLogger(f"tether.mcp.{namespace}")

    @contextlib.contextmanager
    def tracking(self, ctx: ToolContext) -> Iterator[None]:
        """`ctx` counted among the calls in flight on this server while the block runs."""
        key = self.track(ctx)
        try:
            yield
        finally:
            self.untrack(key, ctx)

    def track(self, ctx: ToolContext) -> int:
        """Count `ctx` among the calls in flight (what a server's request is attributed to) until
        `untrack(key, ctx)` with the key returned; the two as a pair, without a generator per call."""
        key = next(self._keys)
        self._calls[key] = ctx
        return key

    def untrack(self, key: int, ctx: ToolContext) -> None:
        """The call `track` returned `key` for has ended; its sampling count goes with its last call."""
        del self._calls[key]
        if ctx.call_id in self._sampled and ctx.call_id not in (c.call_id for c in self._calls.values()):
            del self._sampled[ctx.call_id]

    def progress_callback(self, ctx: ToolContext, tool: str) -> ProgressFnT:
        """Each progress notification of a call, as a `progress` event of the running command."""

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            ctx.emit("progress", {"call_id": ctx.call_id, "server": self.namespace, "tool": tool,
                                  "progress": progress, "total": total,
                                  "message": None if message is None else message[:MAX_QUESTION_CHARS]})

        return on_progress

    def client_options(self) -> dict[str, Any]:
        """The `mcp.Client` arguments that declare and serve the capabilities."""
        options: dict[str, Any] = {"elicitation_callback": self._on_elicit, "list_roots_callback": self._on_roots,
                                   "logging_callback": self._on_log, "log_level": "debug"}
        if self.hooks.sample is not None:
            options["sampling_callback"] = self._on_sample
        return options

    def _only_call(self) -> ToolContext | None:
        calls = {ctx.call_id: ctx for ctx in self._calls.values()}  # one command may be tracked twice
        return next(iter(calls.values())) if len(calls) == 1 else None

    async def _on_log(self, params: mcp_types.LoggingMessageNotificationParams) -> None:
        data = params.data if isinstance(params.data, str) else repr(params.data)
        where = f"{params.logger}: " if params.logger else ""
        self.server_log.log(_LEVELS.get(str(params.level), logging.INFO), "%s%s", where, data[:MAX_QUESTION_CHARS])

    async def _on_roots(self, context: Any) -> mcp_types.ListRootsResult:
        import mcp_types

        ctx = self._only_call() or self._context()
        return mcp_types.ListRootsResult(roots=file_roots(ctx) if ctx is not None else [])

    async def _on_elicit(self, context: Any, params: Any) -> mcp_types.ElicitResult:
        import mcp_types

        ctx = self._only_call()
        if ctx is None:
            why = "no call of this server is running" if not self._calls else "several calls are running"
            logger.warning("server %s asked a question while %s: declined", self.namespace, why)
            return mcp_types.ElicitResult(action="decline")
        if getattr(params, "mode", "form") != "form":
            # URL mode sends the person to a web page; nothing here can show one safely yet
            ctx.emit("elicitation", {"call_id": ctx.call_id, "server": self.namespace,
                                     "message": str(params.message)[:MAX_QUESTION_CHARS],
                                     "declined": "a URL elicitation is not supported"})
            return mcp_types.ElicitResult(action="decline")
        schema = params.requested_schema
        schema = schema if isinstance(schema, dict) else schema.model_dump(by_alias=True, exclude_none=True)
        if len(json.dumps(schema, default=str)) > MAX_SCHEMA_CHARS:  # it travels in an event frame
            logger.warning("server %s asked a question with a schema over %d characters: declined", self.namespace,
                           MAX_SCHEMA_CHARS)
            return mcp_types.ElicitResult(action="decline")
        request = ElicitationRequest(id=self.hooks.next_id(), server=self.namespace, call_id=ctx.call_id,
                                     session_id=ctx.session_id, message=str(params.message)[:MAX_QUESTION_CHARS],
                                     schema=schema)
        answer = await self._ask(ctx, request)
        ctx.emit("elicitation_answered", {"id": request.id, "call_id": ctx.call_id, "server": self.namespace,
                                          "action": answer.action})
        return mcp_types.ElicitResult(action=answer.action, content=answer.content)

    async def _ask(self, ctx: ToolContext, request: ElicitationRequest) -> ElicitationAnswer:
        ctx.emit("elicitation", request.event())
        elicit = self.hooks.elicit
        if elicit is None:
            logger.info("server %s asked %r and nobody can answer here: declined", self.namespace, request.message)
            return ElicitationAnswer("decline")
        try:
            async with asyncio.timeout(self.hooks.elicit_timeout):
                answer = await elicit(request)
        except TimeoutError:
            logger.info("server %s: question %s unanswered after %gs: cancelled", self.namespace, request.id,
                        self.hooks.elicit_timeout)
            return ElicitationAnswer("cancel")
        except Exception as exc:  # a broken answerer must not leave the server waiting
            logger.warning("server %s: question %s could not be asked: %s", self.namespace, request.id, exc)
            return ElicitationAnswer("cancel")
        if answer.action != "accept":
            return ElicitationAnswer(answer.action)
        problem = check_answer(request.schema, answer.content or {})
        if problem:
            logger.warning("server %s: answer to %s refused: %s", self.namespace, request.id, problem)
            return ElicitationAnswer("cancel")
        return answer

    async def _on_sample(self, context: Any, params: mcp_types.CreateMessageRequestParams) -> Any:
        import mcp_types

        ctx = self._only_call()
        if ctx is None:
            return _sampling_error("no single call of this server is running to charge the request to")
        mode = getattr(ctx.policy, "mcp_sampling", "off")
        sample = self.hooks.sample
        if mode == "off" or sample is None:
            ctx.emit("sampling", {"call_id": ctx.call_id, "server": self.namespace, "refused": "policy"})
            logger.info("server %s asked for an LLM completion: refused (policy mcp_sampling: %s)",
                        self.namespace, mode)
            return _sampling_error("sampling refused by this device's policy (mcp_sampling)")
        messages = [_text_message(m) for m in params.messages]
        if sum(len(m["content"]) for m in messages) + len(params.system_prompt or "") > MAX_SAMPLING_PROMPT_CHARS:
            return _sampling_error(f"sampling refused: the messages are over {MAX_SAMPLING_PROMPT_CHARS} characters")
        used = self._sampled.get(ctx.call_id, 0)
        if used >= MAX_SAMPLING_CALLS:
            return _sampling_error(f"sampling budget spent: {MAX_SAMPLING_CALLS} requests per command")
        self._sampled[ctx.call_id] = used + 1
        request = SamplingRequest(server=self.namespace, call_id=ctx.call_id,
                                  messages=messages,
                                  system_prompt=params.system_prompt,
                                  max_tokens=max(1, min(params.max_tokens, MAX_SAMPLING_TOKENS)),
                                  temperature=params.temperature)
        if mode == "ask":
            question = ElicitationRequest(
                id=self.hooks.next_id(), server=self.namespace, call_id=ctx.call_id, session_id=ctx.session_id,
                message=f"MCP server {self.namespace} asks to send {len(request.messages)} message(s) to the LLM "
                        f"(up to {request.max_tokens} tokens). Allow?",
                schema={"type": "object", "properties": {}})
            if (await self._ask(ctx, question)).action != "accept":
                return _sampling_error("sampling declined by the person asked")
        try:
            async with asyncio.timeout(self.hooks.sample_timeout):
                reply = await sample(request)
        except Exception as exc:
            logger.warning("server %s: sampling failed: %s", self.namespace, exc)
            return _sampling_error(f"sampling failed: {exc}"[:500])
        logger.info("server %s: sampling answered by %s (call %s, %d of %d)", self.namespace, reply.model,
                    ctx.call_id, used + 1, MAX_SAMPLING_CALLS)
        ctx.emit("sampling", {"call_id": ctx.call_id, "server": self.namespace, "model": reply.model,
                              "chars": len(reply.text)})
        return mcp_types.CreateMessageResult(role="assistant", model=reply.model,
                                             content=mcp_types.TextContent(type="text", text=reply.text))


def _text_message(message: mcp_types.SamplingMessage) -> dict[str, str]:
    parts = [getattr(block, "text", None) or f"[{getattr(block, 'type', 'content')}]"
             for block in message.content_as_list]
    return {"role": str(message.role), "content": "\n".join(parts)}


def _sampling_error(message: str) -> mcp_types.ErrorData:
    import mcp_types

    return mcp_types.ErrorData(code=-1, message=message)


def check_answer(schema: dict[str, Any], content: dict[str, Any]) -> str | None:
    """Why an answer does not fit the requested schema (required keys, primitive types, enums), or None."""
    props: dict[str, Any] = schema.get("properties") or {}
    missing = [k for k in schema.get("required") or [] if k not in content]
    if missing:
        return f"missing {', '.join(missing)}"
    types: dict[str, type | tuple[type, ...]] = {"string": str, "boolean": bool, "integer": int,
                                                 "number": (int, float)}
    for key, value in content.items():
        prop = props.get(key)
        if prop is None:
            return f"unknown field {key!r}"
        expected = types.get(str(prop.get("type")))
        if expected is not None and (not isinstance(value, expected) or
                                     (prop.get("type") != "boolean" and isinstance(value, bool))):
            return f"{key}: expected {prop.get('type')}"
        if "enum" in prop and value not in prop["enum"]:
            return f"{key}: not one of {prop['enum']}"
    return None


def coerce_answer(schema: dict[str, Any], key: str, text: str) -> Any:
    """A typed value for a field from what a person typed (JSON-ish for numbers and booleans)."""
    kind = (schema.get("properties") or {}).get(key, {}).get("type")
    if kind == "boolean":
        return text.strip().lower() in ("y", "yes", "true", "1")
    if kind == "integer":
        return int(text)
    if kind == "number":
        return float(text)
    return text
