"""Who answers an external MCP server's questions and sampling requests when the CLI runs the device.

`tether exec` (local) asks the person at the terminal; without a terminal nobody is asked and the
server hears "decline". Sampling uses the configured LLM, only when there is one (the device
declares the capability only then) and only as far as the policy's `mcp_sampling` allows.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tether.device.mcp.client.client_caps import (
    ElicitationAnswer,
    ElicitationRequest,
    MCPClientHooks,
    Sampler,
    SamplingReply,
    SamplingRequest,
    coerce_answer,
)

if TYPE_CHECKING:
    from tether.agent.llm.chat import LLMClient
    from tether.client.rest import RemoteServer
    from tether.protocol.messages import Event


def llm_sampler(llm: LLMClient) -> Sampler:
    """A sampler that asks `llm` (text in, text out; the caps module budgets and audits it)."""

    async def sample(request: SamplingRequest) -> SamplingReply:
        messages: list[dict[str, Any]] = []
        if request.system_prompt:
            messages.append({"role": "system", "content": request.system_prompt})
        messages.extend(request.messages)
        reply = await llm.complete(messages, max_tokens=request.max_tokens)
        text = reply.text
        if reply.completion_tokens > request.max_tokens:  # a server that ignores max_tokens: cut the reply
            text = text[:request.max_tokens * 4]
        return SamplingReply(text=text, model=llm.settings.model)

    return sample


def _read(prompt: str) -> str:
    """One line from the terminal, the prompt on stderr (stdout stays the result's); EOFError at the end."""
    from tether.cli.views.safe_text import visible

    sys.stderr.write(visible(prompt))  # field names and choices come from an external MCP server
    sys.stderr.flush()
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\r\n")


def _prompt_sync(request: ElicitationRequest) -> ElicitationAnswer:
    """Ask at the terminal; an empty answer declines, end of input or a bad value cancels."""
    from rich.markup import escape

    from tether.cli.views.safe_text import console

    out = console(err=True)
    out.print(f"[bold yellow]? MCP server {escape(request.server)} asks:[/bold yellow] ", end="")
    out.print(request.message, markup=False, highlight=False)
    props: dict[str, Any] = request.schema.get("properties") or {}
    try:
        if not props:
            reply = _read("  accept? [y/N] ").strip().lower()
            return ElicitationAnswer("accept", {}) if reply in ("y", "yes") else ElicitationAnswer("decline")
        content: dict[str, Any] = {}
        required = set(request.schema.get("required") or [])
        for key, prop in props.items():
            choices = prop.get("enum")
            hint = f" ({'/'.join(map(str, choices))})" if choices else f" [{prop.get('type', 'string')}]"
            label = prop.get("description") or prop.get("title") or key
            text = _read(f"  {label}{hint} ({'empty: decline' if key in required else 'empty: skip'}): ")
            if not text:
                if key in required:
                    return ElicitationAnswer("decline")
                continue
            content[key] = coerce_answer(request.schema, key, text)
        return ElicitationAnswer("accept", content)
    except (EOFError, KeyboardInterrupt, ValueError):
        return ElicitationAnswer("cancel")


async def terminal_elicitor(request: ElicitationRequest) -> ElicitationAnswer:
    # input() blocks; the prompt runs in the default executor so the device's loop keeps serving
    return await asyncio.get_running_loop().run_in_executor(None, _prompt_sync, request)


def cli_hooks(llm: LLMClient | None, *, interactive: bool | None = None) -> MCPClientHooks:
    """The hooks for a device the CLI runs: the terminal asks when there is one, the LLM samples when
    one is configured."""
    if interactive is None:
        interactive = sys.stdin.isatty()
    return MCPClientHooks(elicit=terminal_elicitor if interactive else None,
                          sample=llm_sampler(llm) if llm is not None else None)


def configured_llm() -> LLMClient | None:
    """The LLM of `TETHER_LLM_*` or the config file, or None (also when its config is unusable: a
    device command does not fail for want of an LLM it may never need)."""
    from tether.agent.llm.chat import LLMClient
    from tether.agent.llm.settings import resolve_llm_settings

    try:
        settings = resolve_llm_settings()
    except (ValueError, OSError):
        return None
    return LLMClient(settings) if settings is not None else None


def remote_questions(remote: RemoteServer, device: str, *, interactive: bool | None = None, raw: bool = False
                     ) -> Callable[[Event], None]:
    """For `tether exec --device`: the events of the command's stream as the CLI shows them, with an
    MCP server's question asked at this terminal and the answer posted to the server (which needs a
    token with the `approve` scope); without a terminal, the question and how to answer it."""
    from tether.cli.basics import remote_message, stream_output
    from tether.cli.views.safe_text import console
    from tether.client.rest import RemoteError

    ask = sys.stdin.isatty() if interactive is None else interactive
    err = console(err=True)

    def on_event(event: Event) -> None:
        data = event.data
        if event.kind != "elicitation" or "id" not in data:
            stream_output(event.kind, data, raw)
            return
        schema = data.get("schema")
        request = ElicitationRequest(id=str(data["id"]), server=str(data.get("server", "?")),
                                     call_id=event.call_id, session_id=None, message=str(data.get("message", "")),
                                     schema=schema if isinstance(schema, dict) else {})
        if not ask:
            err.print(f"MCP server {request.server} asks (question {request.id}): ", end="", markup=False)
            err.print(request.message, markup=False, highlight=False)
            err.print(f"  answer with POST /api/v1/devices/{device}/questions/{request.id} "
                      '{"action": "accept", "content": {...}} (a token with the approve scope)', markup=False)
            return
        answer = _prompt_sync(request)
        try:
            remote.answer_question(device, request.id, answer.action, answer.content)
        except RemoteError as exc:
            err.print(f"error: the answer was not taken: {remote_message(exc)}", markup=False, highlight=False,
                      soft_wrap=True)

    return on_event
