"""Small pieces the executor uses about steps: the tools a device offers, how a person's answer
maps to an option, and how a finished step is summarized for the LLM (compact, results cut short)."""

from __future__ import annotations

import json
from typing import Any

from tether.agent.task import StepRecord
from tether.protocol.dispatcher import BasicCommandDispatcher
from tether.protocol.models import Command, ToolInfo


async def discover_tools(dispatcher: BasicCommandDispatcher) -> list[ToolInfo]:
    """The tools a device offers, through its dispatcher's `list_tools` meta tool."""
    [result] = await dispatcher.execute_commands([Command(tool_name="list_tools")])
    if not result.ok or not isinstance(result.result, list):
        raise RuntimeError(f"cannot list the device's tools: {result.error or 'no list returned'}")
    return [ToolInfo.model_validate(item) for item in result.result]


def match_option(answer: str, options: list[str]) -> str | None:
    """The option an answer names: its number, its text, or a unique prefix of it; None for free words."""
    text = answer.strip().lower()
    if text.isdigit() and 1 <= int(text) <= len(options):
        return options[int(text) - 1]
    for option in options:
        if text == option.lower():
            return option
    starting = [option for option in options if text and option.lower().startswith(text)]
    if len(starting) == 1:  # "skip" for "skip this step"
        return starting[0]
    return None


def short(value: Any, limit: int = 600) -> Any:
    text = json.dumps(value, default=str)
    return value if len(text) <= limit else text[:limit] + "…"


def history_row(record: StepRecord) -> dict[str, Any]:
    return {"step": record.index + 1, "skill": record.step.skill, "args": record.step.args,
            "status": record.result.status.value, "error": record.result.error,
            "result": short(record.result.result, 300)}
