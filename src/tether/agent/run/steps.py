"""Small pieces the executor uses about steps: the tools a device offers, how a person's answer
maps to an option, and how a finished step is summarized for the LLM (compact, results cut short)."""

from __future__ import annotations

import json
from typing import Any

from tether.agent.run.task import StepRecord
from tether.protocol.dispatcher import BasicCommandDispatcher
from tether.protocol.models import Command, Result, ResultStatus, ToolInfo
from tether.protocol.profile import DeviceRequirements


async def discover_tools(dispatcher: BasicCommandDispatcher) -> list[ToolInfo]:
    """The tools a device offers, through its dispatcher's `list_tools` meta tool."""
    [result] = await dispatcher.execute_commands([Command(tool_name="list_tools")])
    if not result.ok or not isinstance(result.result, list):
        raise RuntimeError(f"cannot list the device's tools: {result.error or 'no list returned'}")
    return [ToolInfo.model_validate(item) for item in result.result]


async def fan_out_step(dispatcher: BasicCommandDispatcher, command: Command, requires: DeviceRequirements | None,
                       timeout: float) -> Result:
    """A step `on: all`: the command on every device meeting `requires`, through the dispatcher's
    `fan_out` (the agent server's; a local dispatcher has no fleet). The result is each device's line
    and the summary; the step succeeds only when every device did."""
    fan_out = getattr(dispatcher, "fan_out", None)
    if fan_out is None:
        return Result.failure("on: all runs the step on every device of an agent server; this task runs "
                              "locally, where there is one device", command.call_id)
    try:
        data = await fan_out(command, requires or DeviceRequirements(), timeout)
    except ValueError as exc:  # nothing matched, or too many devices: nothing was sent
        return Result.failure(f"on: all: {exc}", command.call_id)
    summary = data["summary"]
    if summary["ok"] == summary["total"]:
        return Result(status=ResultStatus.SUCCESS, result=data, call_id=command.call_id)
    counts = ", ".join(f"{summary[k]} {k.replace('_', ' ')}" for k in ("failed", "offline", "timed_out",
                                                                      "cancelled") if summary[k])
    first = next(d for d in data["devices"] if d["status"] != "ok")
    return Result.failure(f"on: all: {summary['ok']} of {summary['total']} devices succeeded ({counts}); "
                          f"{first['device']}: {first.get('error') or first['status']}", command.call_id,
                          result=data)


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
