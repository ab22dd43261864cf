"""The final answer (seed 004's formatAnswer): a short reply to the request, from the steps' results.

With an LLM: one call, streamed through `on_token`. Without one (or when the call fails): a
deterministic summary of what ran and what came of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tether.agent.llm import LLMClient, LLMError

if TYPE_CHECKING:
    from tether.agent.task import StepRecord, Task

RESULT_CHARS = 400


def _outcome(record: StepRecord) -> str:
    value: Any = record.result.result
    if isinstance(value, dict):
        for key in ("stdout", "content", "path", "preview"):
            if value.get(key):
                value = value[key]
                break
        else:
            if "exitCode" in value:  # a command that printed nothing: its exit code says it all
                value = f"exit code {value['exitCode']}"
    text = value if isinstance(value, str) else json.dumps(value, default=str) if value is not None else ""
    text = " ".join(text.split())
    return text if len(text) <= RESULT_CHARS else text[: RESULT_CHARS - 1] + "…"


def final_records(task: Task) -> list[StepRecord]:
    """The last attempt of every step that ran, in plan order."""
    last: dict[int, StepRecord] = {}
    for record in task.steps:
        last[record.index] = record
    return [last[i] for i in sorted(last)]


def summarize(task: Task) -> str:
    """The deterministic answer: one line per step with its outcome."""
    records = final_records(task)
    ok = sum(1 for r in records if r.result.ok)
    lines = [f"Done: {ok} of {len(records)} step(s) succeeded for “{task.request.strip() or 'the plan'}”."]
    for record in records:
        mark = "✓" if record.result.ok else "✗"
        label = record.step.description or record.step.skill
        detail = _outcome(record) if record.result.ok else (record.result.error or "failed")
        lines.append(f"{mark} {record.index + 1}. {label}" + (f" — {detail}" if detail else ""))
    return "\n".join(lines)


def build_answer_messages(task: Task) -> list[dict[str, Any]]:
    lines = [f"Request: {task.request}", "Steps run:"]
    for record in final_records(task):
        status = "ok" if record.result.ok else f"failed: {record.result.error}"
        lines.append(f"{record.index + 1}. {record.step.skill} {json.dumps(record.step.args, default=str)} "
                     f"→ {status}; {_outcome(record)}")
    return [
        {"role": "system", "content": "You are tether. Tell the user, in two or three plain sentences, what was "
                                      "done for their request and the key result. No preamble, no markdown."},
        {"role": "user", "content": "\n".join(lines)},
    ]


async def format_answer(task: Task, llm: LLMClient | None = None, *,
                        on_token: Callable[[str], None] | None = None) -> str:
    """The final answer: the LLM's (streamed) when one is given and answers, else `summarize(task)`."""
    if llm is None:
        return summarize(task)
    try:
        reply = await llm.complete(build_answer_messages(task), stream=on_token is not None, on_token=on_token)
    except LLMError:
        return summarize(task)
    return reply.text.strip() or summarize(task)
