"""Who answers an external MCP server's questions and sampling requests when the CLI runs the device.

`tether exec` (local) asks the person at the terminal; without a terminal nobody is asked and the
server hears "decline". Sampling uses the configured LLM, only when there is one (the device
declares the capability only then) and only as far as the policy's `mcp_sampling` allows.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING, Any

from tether.device.mcp_client_caps import (
    ElicitationAnswer,
    ElicitationRequest,
    MCPClientHooks,
    Sampler,
    SamplingReply,
    SamplingRequest,
    coerce_answer,
)

if TYPE_CHECKING:
    from tether.agent.llm import LLMClient


def llm_sampler(llm: LLMClient) -> Sampler:
    """A sampler that asks `llm` (text in, text out; the caps module budgets and audits it)."""

    async def sample(request: SamplingRequest) -> SamplingReply:
        messages: list[dict[str, Any]] = []
        if request.system_prompt:
            messages.append({"role": "system", "content": request.system_prompt})
        messages.extend(request.messages)
        reply = await llm.complete(messages)
        return SamplingReply(text=reply.text, model=llm.settings.model)

    return sample


def _prompt_sync(request: ElicitationRequest) -> ElicitationAnswer:
    """Ask at the terminal (stderr, so a piped stdout stays the result's); empty answer to a yes/no
    question declines, end of input cancels."""
    from rich.console import Console

    out = Console(stderr=True)
    out.print(f"[bold yellow]? MCP server {request.server} asks:[/bold yellow] ", end="")
    out.print(request.message, markup=False, highlight=False)
    props: dict[str, Any] = request.schema.get("properties") or {}
    try:
        if not props:
            reply = input("  accept? [y/N] ").strip().lower()
            return ElicitationAnswer("accept" if reply in ("y", "yes") else "decline", {} if reply else None)
        content: dict[str, Any] = {}
        for key, prop in props.items():
            choices = prop.get("enum")
            hint = f" ({'/'.join(map(str, choices))})" if choices else f" [{prop.get('type', 'string')}]"
            label = prop.get("title") or prop.get("description") or key
            text = input(f"  {label}{hint} (empty: decline): ")
            if not text:
                return ElicitationAnswer("decline")
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
