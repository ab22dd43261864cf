"""The final answer (seed 004's formatAnswer): a short reply to the request, from the steps' results.

With an LLM: one call, streamed through `on_token`. Without one (or when the call fails): a
deterministic summary of what ran and what came of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tether.agent.llm.chat import LLMClient, LLMError

if TYPE_CHECKING:
    from tether.agent.run.task import StepRecord, Task

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


def skipped_steps(task: Task) -> set[int]:
    """The plan steps the person chose to skip ("skip this step"), whether or not they had run."""
    return {e.data["step"] for e in task.events if e.kind == "skipped" and isinstance(e.data.get("step"), int)}


def _step_lines(task: Task) -> list[tuple[int, str, StepRecord | None, bool]]:
    """Every step of the plan (and any that ran beyond it), in order: (index, label, its last attempt
    or None when it never ran, whether it was skipped)."""
    last = {r.index: r for r in final_records(task)}
    skipped = skipped_steps(task)
    planned = task.plan.steps if task.plan else []
    lines = []
    for index in sorted(set(range(len(planned))) | set(last) | skipped):
        record = last.get(index)
        step = record.step if record is not None else planned[index] if index < len(planned) else None
        label = (step.description or step.skill) if step is not None else f"step {index + 1}"
        lines.append((index, label, record, index in skipped))
    return lines


def summarize(task: Task) -> str:
    """The deterministic answer: how many of the plan's steps succeeded (a skipped or unrun step counts
    as a step that did not), then one line per step with its outcome."""
    lines = _step_lines(task)
    ok = sum(1 for _, _, record, skipped in lines if record is not None and record.result.ok and not skipped)
    skipped_count = sum(1 for *_, skipped in lines if skipped)
    also = f" ({skipped_count} skipped)" if skipped_count else ""
    out = [f"Done: {ok} of {len(lines)} step(s) succeeded{also} for “{task.request.strip() or 'the plan'}”."]
    for index, label, record, skipped in lines:
        if record is None:
            mark, detail = "-", "skipped, not run" if skipped else "not run"
        elif skipped:
            mark, detail = "-", f"skipped after it failed: {record.result.error or 'failed'}"
        elif record.result.ok:
            mark, detail = "✓", _outcome(record)
        else:
            mark, detail = "✗", record.result.error or "failed"
        out.append(f"{mark} {index + 1}. {label}" + (f" — {detail}" if detail else ""))
    return "\n".join(out)


def build_answer_messages(task: Task) -> list[dict[str, Any]]:
    lines = [f"Request: {task.request}", "Steps:"]
    for index, _, record, skipped in _step_lines(task):
        if record is None:
            step = task.plan.steps[index] if task.plan and index < len(task.plan.steps) else None
            what = f"{step.skill} {json.dumps(step.args, default=str)}" if step is not None else "a step"
            lines.append(f"{index + 1}. {what} → {'skipped by the user, not run' if skipped else 'not run'}")
            continue
        status = "ok" if record.result.ok else f"failed: {record.result.error}"
        if skipped:
            status += " (then skipped by the user)"
        lines.append(f"{index + 1}. {record.step.skill} {json.dumps(record.step.args, default=str)} "
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
