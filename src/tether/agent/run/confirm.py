"""Confirmation: a plan shown to a person who says "run" before any step runs.

`tether run --confirm` asks for every plan; a server asks for tasks created by a token whose `confirm`
is `always`, or `destructive` when a plan has a step that changes something (a tool of type `action`,
as opposed to `data_collection`, or one whose type is unknown). Each part of a plan is confirmed when it
is made: the first plan, and the parts planned after an observation or a re-plan. The question has the
kind `confirmation`, so `tether approve` (run) and `tether answer` (run/cancel) both answer it.

A confirmation is bound to the plan it showed (`plan_digest`): the steps, their devices and arguments in
full. The runner recomputes it when the answer comes; a plan that differs by then is asked about again.
Only a person confirms: an agent's token is refused (server/trust/approvals.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Literal

from tether.agent.planning.plan import OBSERVE, PlanStep, find_tool
from tether.protocol.models import ToolInfo

ConfirmMode = Literal["never", "destructive", "always"]
CONFIRM_MODES: tuple[str, ...] = ("never", "destructive", "always")
OPTION_RUN = "run"
OPTION_CANCEL = "cancel"
CONFIRMATION = "confirmation"  # the Question kind
_YES = {"run", "yes", "y", "approve", "ok"}
_NO = {"cancel", "no", "n", "deny"}
STEP_TEXT = 160


def is_destructive(step: PlanStep, tools: Mapping[str | None, list[ToolInfo]]) -> bool:
    """Whether a step may change something: its tool is an action, or it is not known to be read-only."""
    if step.skill == OBSERVE:
        return False
    for name in (step.device, None, *tools):
        if name in tools and (tool := find_tool(tools[name], step.skill)) is not None:
            return tool.tool_type != "data_collection"
    return True


def needs_confirmation(mode: str, steps: Sequence[PlanStep], tools: Mapping[str | None, list[ToolInfo]]) -> bool:
    if mode == "always":
        return bool(steps)
    if mode == "destructive":
        return any(is_destructive(step, tools) for step in steps)
    return False


def plan_text(steps: Sequence[PlanStep], first: int = 0) -> str:
    """The steps as a person reads them: number (from 1), skill, arguments, what it does."""
    lines = []
    for offset, step in enumerate(steps):
        args = json.dumps(step.args, default=str, ensure_ascii=False)
        if len(args) > STEP_TEXT:
            args = args[:STEP_TEXT] + "…"
        where = f" on {step.device}" if step.device else ""
        what = f" — {step.description}" if step.description else ""
        lines.append(f"{first + offset + 1}. {step.skill}{where} {args}{what}")
    return "\n".join(lines)


def plan_digest(steps: Sequence[PlanStep], first: int = 0) -> str:
    """`sha256:` over exactly what a confirmation shows, in full (not the shortened text): each step's
    number, skill, device, arguments and description. Equal digests mean the same plan part."""
    shown = [[first + i, s.skill, s.device, s.on, s.requires.model_dump(mode="json") if s.requires else None,
              s.args, s.description] for i, s in enumerate(steps)]
    text = json.dumps(shown, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def confirmation_answer(answer: str) -> bool | None:
    """True to run, False to cancel, None when the answer is neither (asked again)."""
    text = answer.strip().lower()
    if text in _YES or text == "1":
        return True
    if text in _NO or text == "2":
        return False
    return None
