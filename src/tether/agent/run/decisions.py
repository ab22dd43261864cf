"""Recovery's decisions about a failed step, typed and validated: `AutoPatch`, `Replan`, `AskUser`.

    AUTO_PATCH {patched_args, note}                      retry the same step with other arguments
    REPLAN     {suggestion, constraint, alternative_cwd} plan the rest again with the failure in mind
    ASK_USER   {question, options}                       a person decides

`parse_decision` reads one from an LLM's reply (JSON under `DECISION_JSON_SCHEMA`) and `validate_decision`
says what keeps one from being applied; `RecoveryInput` is what recovery knows about the failure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tether.agent.planning.plan import PlanStep, check_args
from tether.errors import AgentError
from tether.protocol.models import Result, ToolInfo

OPTION_APPROVE = "approve"
OPTION_DENY = "deny"
OPTION_CANCEL = "cancel"
OPTION_RETRY = "retry"
OPTION_SKIP = "skip this step"
OPTION_DESKTOP = "use ~/Desktop instead"
OPTION_ELSEWHERE = "choose another location"
OPTION_OTHER_WAY = "do it another way"


Source = Literal["fast_path", "llm", "budget", "fallback", "user"]


class AutoPatch(BaseModel):
    """Retry the same step with `patched_args` (the whole argument object); `note` says why."""

    model_config = ConfigDict(extra="forbid")

    decision: Literal["AUTO_PATCH"] = "AUTO_PATCH"
    patched_args: dict[str, Any]
    note: str = ""
    source: Source = "llm"


class Replan(BaseModel):
    """Plan the rest of the task again, with `suggestion`, `constraint` and `alternative_cwd` in the prompt."""

    model_config = ConfigDict(extra="forbid")

    decision: Literal["REPLAN"] = "REPLAN"
    suggestion: str = ""
    constraint: str | None = None
    alternative_cwd: str | None = None
    source: Source = "llm"


class AskUser(BaseModel):
    """A person decides: `question` with at least one of `options`; `kind` "approval" for held changes
    (`changes`, `digest`)."""

    model_config = ConfigDict(extra="forbid")

    decision: Literal["ASK_USER"] = "ASK_USER"
    question: str = Field(..., min_length=1)
    options: list[str] = Field(..., min_length=1)
    kind: Literal["question", "approval"] = "question"
    reason: str = Field(default="", description="why the question is asked (budget, LLM error, ...)")
    changes: list[dict[str, Any]] = Field(default_factory=list,
                                          description="an approval of a command's held changes: exactly those "
                                                      "changes, each {path, kind, bytes, rule}")
    digest: str | None = Field(default=None, description="an approval: the device's digest of what it asks "
                                                         "about (the approved command carries it back)")
    source: Source = "llm"


RecoveryDecision = Annotated[AutoPatch | Replan | AskUser, Field(discriminator="decision")]
DECISION_ADAPTER: TypeAdapter[AutoPatch | Replan | AskUser] = TypeAdapter(RecoveryDecision)


# What the LLM answers under (the `source`, `kind` and `reason` fields are tether's own).
DECISION_JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "decision": {"type": "string", "enum": ["AUTO_PATCH", "REPLAN", "ASK_USER"]},
        "patched_args": {"type": "object"},
        "note": {"type": "string"},
        "suggestion": {"type": "string"},
        "constraint": {"type": ["string", "null"]},
        "alternative_cwd": {"type": ["string", "null"]},
        "question": {"type": "string"},
        "options": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["decision"],
    "additionalProperties": False,
}


_FIELDS = {
    "AUTO_PATCH": {"decision", "patched_args", "note"},
    "REPLAN": {"decision", "suggestion", "constraint", "alternative_cwd"},
    "ASK_USER": {"decision", "question", "options"},
}


class DecisionError(AgentError, ValueError):
    """A decision that cannot be applied; the message lists why."""


@dataclass
class RecoveryInput:
    """What recovery knows about the failure and the task so far."""

    request: str
    step: PlanStep
    index: int
    result: Result
    tool: ToolInfo | None = None
    patches_used: int = 0
    tried_args: list[dict[str, Any]] = field(default_factory=list)
    replans_used: int = 0
    history: Sequence[Any] = ()
    can_replan: bool = True


def validate_decision(decision: AutoPatch | Replan | AskUser, tool: ToolInfo | None = None) -> list[str]:
    """Problems that keep `decision` from being applied (empty when it is fine)."""
    problems: list[str] = []
    if isinstance(decision, AutoPatch):
        if tool is not None:
            problems += [f"patched_args: {p}" for p in check_args(tool, decision.patched_args)]
    elif isinstance(decision, AskUser):
        if not decision.question.strip():
            problems.append("question is empty")
        if not [o for o in decision.options if o.strip()]:
            problems.append("options: at least one option is needed")
    elif (isinstance(decision, Replan) and decision.alternative_cwd is not None
          and not decision.alternative_cwd.startswith(("/", "~"))):
        problems.append("alternative_cwd must be an absolute path")
    return problems


def parse_decision(text: str, tool: ToolInfo | None = None, *, source: Source = "llm") -> AutoPatch | Replan | AskUser:
    """A decision from the LLM's text (``` fences and surrounding prose tolerated); `DecisionError` if bad."""
    data = _first_object(text)
    if not isinstance(data, dict):
        raise DecisionError("the reply is not a JSON object")
    kind = str(data.get("decision", "")).strip().upper().replace("-", "_").replace(" ", "_")
    if kind not in _FIELDS:
        raise DecisionError(f"decision must be AUTO_PATCH, REPLAN or ASK_USER, not {data.get('decision')!r}")
    payload = {k: v for k, v in data.items() if k in _FIELDS[kind]}
    payload["decision"] = kind
    payload["source"] = source
    try:
        decision = DECISION_ADAPTER.validate_python(payload)
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'reply'}: {e['msg']}" for e in exc.errors())
        raise DecisionError(details) from None
    problems = validate_decision(decision, tool)
    if problems:
        raise DecisionError("; ".join(problems))
    return decision


def _first_object(text: str) -> Any:
    fenced = re.findall(r"```(?:json|JSON)?\s*\n?(.*?)```", text or "", re.DOTALL)
    for candidate in [*fenced, text or ""]:
        candidate = candidate.strip()
        try:
            return json.loads(candidate)
        except json.JSONDecodeError:
            pass
        decoder = json.JSONDecoder()
        for match in re.finditer(r"\{", candidate):
            try:
                value, _ = decoder.raw_decode(candidate, match.start())
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None
