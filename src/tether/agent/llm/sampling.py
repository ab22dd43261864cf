"""`DeviceSampler`: devices' sampling requests answered by the agent server's LLM.

An external MCP server on a device may ask for an LLM completion (MCP sampling) where the device's policy
allows it; the device forwards the request over AIP and the hub hands it to the sampler it was built with.
"""

from __future__ import annotations

import logging
from typing import Any

from tether.agent.llm.chat import LLMClient

logger = logging.getLogger(__name__)

MAX_SAMPLING_CHARS = 64_000  # what a device may send this server's LLM in one sampling request
MAX_SAMPLING_TOKENS = 4000  # the most a reply may be asked to hold, whatever the request says


class DeviceSampler:
    """A `tether.server.aip.questions.asked.Sampler` on `llm` (the client the task service plans with, so the
    LLM's call and token counters include sampling). It neither opens nor closes the client."""

    def __init__(self, llm: LLMClient) -> None:
        self.llm = llm

    async def __call__(self, device: str, request: dict[str, Any]) -> tuple[str, str]:
        """Answer `device`'s sampling request (its `system_prompt`, `messages` of `{role: user|assistant,
        content: text}`, `max_tokens`, `server`): returns (text, model). Raises `ValueError` for a malformed
        message or messages over `MAX_SAMPLING_CHARS` characters; the LLM client's errors pass through.
        The device budgets the requests per command; this bounds each."""
        messages: list[dict[str, Any]] = []
        if isinstance(request.get("system_prompt"), str) and request["system_prompt"]:
            messages.append({"role": "system", "content": request["system_prompt"]})
        for message in request.get("messages") or []:
            if not isinstance(message, dict) or message.get("role") not in ("user", "assistant") \
                    or not isinstance(message.get("content"), str):
                raise ValueError("a sampling message must be {role: user|assistant, content: text}")
            messages.append({"role": message["role"], "content": message["content"]})
        if sum(len(m["content"]) for m in messages) > MAX_SAMPLING_CHARS:
            raise ValueError(f"the messages are over {MAX_SAMPLING_CHARS} characters")
        max_tokens = request.get("max_tokens")
        limit = max_tokens if type(max_tokens) is int and 0 < max_tokens <= MAX_SAMPLING_TOKENS else MAX_SAMPLING_TOKENS
        reply = await self.llm.complete(messages, max_tokens=limit)
        logger.info("sampling for device %s (MCP server %s): %d prompt, %d completion tokens", device,
                    str(request.get("server"))[:64], reply.prompt_tokens, reply.completion_tokens)
        return reply.text[:limit * 4], self.llm.settings.model
