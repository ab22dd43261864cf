"""Observation points: what the LLM is shown when a plan stops at `observe` to plan its next part.

A plan is fixed when it is made; many requests need to look first (the largest log, the report changed
today, the labels on a screen). The planner may end a plan with `{"skill": "observe"}`: the executor runs
the steps before it, then asks the planner again with their results, compacted here so that a round
costs few tokens: long text is cut (its size said), long lists shortened, and binary data such as a
screenshot's base64 PNG replaced by its size with a pointer to the tools that read a screen as text
(`get_ui_tree`'s OCR, `browser.act` snapshot). Numbers count steps from 1, as references do.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tether.agent.run.task import StepRecord, Task

TEXT_CHARS = 1500  # per string value
LIST_ITEMS = 40  # per list
RESULT_CHARS = 4000  # per step, after the cuts above
MAX_DEPTH = 8
_BASE64 = re.compile(r"^[A-Za-z0-9+/]+={0,2}$")


def _looks_binary(text: str) -> bool:
    """Base64 of binary data (a screenshot's PNG): no spaces, and the mixed letters and digits that a
    long run of a single word or a hex digest does not have."""
    head = text[:4096].replace("\n", "")
    return (bool(_BASE64.match(head if len(text) <= 4096 else head.rstrip("=")))
            and any(c.isdigit() for c in head) and any(c.isupper() for c in head)
            and any(c.islower() for c in head))


def compact(value: Any, depth: int = 0) -> Any:
    """`value` cut down for a prompt: long strings, long lists and binary blobs say what was left out."""
    if depth > MAX_DEPTH:
        return "…"
    if isinstance(value, str):
        if len(value) > 256 and _looks_binary(value):
            size = len(value.rstrip("=")) * 3 // 4
            return f"[binary data, {size} bytes, not shown; read a screen with get_ui_tree or browser.act snapshot]"
        if len(value) > TEXT_CHARS:
            return value[:TEXT_CHARS] + f"… [{len(value) - TEXT_CHARS} more characters of {len(value)}]"
        return value
    if isinstance(value, dict):
        return {str(k): compact(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        items = [compact(v, depth + 1) for v in value[:LIST_ITEMS]]
        if len(value) > LIST_ITEMS:
            items.append(f"[{len(value) - LIST_ITEMS} more items of {len(value)}]")
        return items
    return value


def latest_records(task: Task, before: int | None = None) -> dict[int, StepRecord]:
    """The last attempt of each step (by index from 0), for steps before `before`."""
    latest: dict[int, StepRecord] = {}
    for record in task.steps:
        if before is None or record.index < before:
            latest[record.index] = record
    return latest


def step_results(task: Task) -> dict[int, Any]:
    """What references read: each step's (numbered from 1) result from its last successful attempt.

    Only steps before the cursor count, so a step replaced by a re-plan is never read by mistake."""
    results: dict[int, Any] = {}
    for record in task.steps:
        if record.index < task.cursor and record.result.ok:
            results[record.index + 1] = record.result.result
    return results


def _row(record: StepRecord) -> str:
    row: dict[str, Any] = {"step": record.index + 1, "skill": record.step.skill, "args": record.step.args,
                           "status": record.result.status.value}
    if record.result.error:
        row["error"] = compact(record.result.error)
    row["result"] = compact(record.result.result)
    text = json.dumps(row, default=str, ensure_ascii=False)
    if len(text) > RESULT_CHARS:
        text = text[:RESULT_CHARS] + f"… [step {record.index + 1}'s result cut at {RESULT_CHARS} characters]"
    return text


def step_row(record: StepRecord) -> str:
    """One finished step as the planner is shown it (JSON, its result compacted)."""
    return _row(record)


def observation_context(task: Task, index: int, note: str = "") -> str:
    """The planner's context at the observation point at step `index` (from 0)."""
    lines = ["Observation point: the steps planned so far have run. Their results:"]
    latest = latest_records(task, before=index)
    skipped = [n + 1 for n in range(index) if n not in latest]
    lines += [_row(latest[n]) for n in sorted(latest)]
    if skipped:
        lines.append(f"Steps {', '.join(map(str, skipped))} were skipped or did not run.")
    if note:
        lines.append(f"You wanted to look at: {note}")
    lines.append(f"Plan the next part from what you see. Your new steps are numbered from {index + 1}; "
                 f'they may use the results above with {{"$ref": "steps.N.result..."}}. End with observe '
                 'again if you must look once more, or answer {"steps": []} if the request is already done.')
    return "\n".join(lines)
