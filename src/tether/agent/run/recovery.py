"""Recovery (seed 004's recoverSkill): what to do about a failed step, as a typed, validated decision.

    AUTO_PATCH {patched_args, note}                      retry the same step with other arguments
    REPLAN     {suggestion, constraint, alternative_cwd} plan the rest again with the failure in mind
    ASK_USER   {question, options}                       a person decides

Fast paths decide the common failures without the LLM: a timeout → a longer timeout; a missing parent
directory → `create_parents` / `mkdir -p`; permission denied, command not found, a policy denial, an
action that needs approval → ASK_USER with concrete options. Anything else goes to the LLM (JSON under
`DECISION_JSON_SCHEMA`), and an LLM error or a reply that does not parse or validate becomes ASK_USER.
Budgets are enforced here too: a patch already tried for this step, or one beyond the per-step budget,
and a re-plan beyond the per-task budget, become ASK_USER — never a loop.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from typing import Any

from tether.agent.llm.chat import LLMClient, LLMError, Message
from tether.agent.planning.plan import PlanStep, find_tool
from tether.agent.planning.planner import compact_schema
from tether.agent.planning.refs import ERROR_CODE as REF_ERROR_CODE
from tether.agent.run.decisions import (
    DECISION_JSON_SCHEMA,
    OPTION_APPROVE,
    OPTION_CANCEL,
    OPTION_DENY,
    OPTION_DESKTOP,
    OPTION_ELSEWHERE,
    OPTION_OTHER_WAY,
    OPTION_RETRY,
    OPTION_SKIP,
    AskUser,
    AutoPatch,
    DecisionError,
    RecoveryInput,
    Replan,
    Source,
    parse_decision,
)
from tether.agent.run.task import Budgets
from tether.protocol.models import Result, ToolInfo

TIMEOUT_CAP_MS = 600_000
DEFAULT_TIMEOUT_MS = 30_000


# -- fast paths -------------------------------------------------------------------------------------

_TIMEOUT_KEYS = ("timeoutMs", "timeout_ms")
_MISSING_PARENT = re.compile(r"parent directory does not exist|no such file or directory", re.I)
_PERMISSION = re.compile(r"permission denied|operation not permitted|\beacces\b|\beperm\b", re.I)
_NOT_FOUND = re.compile(r"command not found|could not start|no such program|not found in path|"
                        r"executable file not found", re.I)
_POLICY = re.compile(r"denied by policy rule '([^']+)'", re.I)


def _payload(result: Result) -> dict[str, Any]:
    return result.result if isinstance(result.result, dict) else {}


def is_timeout(result: Result) -> bool:
    """Whether the failed result says the command timed out."""
    return bool(_payload(result).get("timedOut")) or "timed out" in (result.error or "").lower()


def needs_approval(result: Result) -> bool:
    """Whether the failed result says the command waits for a person's approval."""
    return bool(_payload(result).get("needs_approval")) or "needs approval" in (result.error or "").lower()


def _argv(step: PlanStep) -> list[str]:
    argv = step.args.get("argv")
    return [str(a) for a in argv] if isinstance(argv, list) else []


def _location_options(can_replan: bool) -> list[str]:
    return [OPTION_DESKTOP, OPTION_ELSEWHERE, OPTION_CANCEL] if can_replan else [OPTION_RETRY, OPTION_SKIP,
                                                                               OPTION_CANCEL]


def _label(step: PlanStep) -> str:
    return step.description or step.skill


def fast_path(inp: RecoveryInput) -> AutoPatch | Replan | AskUser | None:
    """A decision for a common failure without asking the LLM, or None."""
    step, result = inp.step, inp.result
    error = result.error or ""
    details = f"{error}\n{_payload(result).get('stderr') or ''}"
    if _payload(result).get("error_code") == REF_ERROR_CODE:
        # the step never ran: an earlier result does not hold what the plan expected of it, so the
        # rest of the plan is wrong, not this step's arguments (a patch would guess the value)
        if inp.can_replan:
            return Replan(suggestion=f"{error}; use what the earlier steps really returned (see their results)",
                          source="fast_path")
        return AskUser(question=f"Step {inp.index + 1} ({_label(step)}) cannot run: {error}",
                       options=[OPTION_SKIP, OPTION_CANCEL], reason="unresolved-ref", source="fast_path")
    if needs_approval(result):
        rule = _payload(result).get("rule") or "approval"
        held = _held_changes(result)
        question = (_changes_question(inp, held) if held else
                    f"Step {inp.index + 1} ({_label(step)}) needs your approval: {error}")
        digest = _payload(result).get("approval_digest")
        return AskUser(question=question, options=[OPTION_APPROVE, OPTION_DENY], kind="approval", reason=str(rule),
                       changes=held or _held_changes(result, "would_change"),
                       digest=digest if isinstance(digest, str) else None, source="fast_path")
    if is_timeout(result):
        key = next((k for k in _TIMEOUT_KEYS if k in step.args), None)
        if key is None and inp.tool is not None:
            key = next((k for k in _TIMEOUT_KEYS if k in (inp.tool.input_schema.get("properties") or {})), None)
        if key is not None:
            old = step.args.get(key)
            old_ms = int(old) if isinstance(old, int | float) and old > 0 else DEFAULT_TIMEOUT_MS
            if old_ms < TIMEOUT_CAP_MS:
                new_ms = min(old_ms * 2, TIMEOUT_CAP_MS)
                return AutoPatch(patched_args={**step.args, key: new_ms},
                                 note=f"timed out; retrying with {key}={new_ms}", source="fast_path")
        return AskUser(question=f"Step {inp.index + 1} ({_label(step)}) timed out: {error}",
                       options=[OPTION_RETRY, OPTION_SKIP, OPTION_CANCEL], reason="timeout", source="fast_path")
    policy = _POLICY.search(error)
    if policy:
        rule = policy.group(1)
        if rule in ("read_roots", "write_roots", "cwd.exists"):
            options = _location_options(inp.can_replan)
        else:
            options = ([OPTION_OTHER_WAY] if inp.can_replan else [OPTION_SKIP]) + [OPTION_CANCEL]
        return AskUser(question=f"The policy refused step {inp.index + 1} ({_label(step)}): {error}. "
                                f"What should I do?", options=options, reason=f"policy:{rule}", source="fast_path")
    if _MISSING_PARENT.search(details):
        patch = _missing_parent_patch(step)
        if patch is not None:
            return patch
    if _PERMISSION.search(details):
        return AskUser(question=f"I don't have permission for step {inp.index + 1} ({_label(step)}): {error}. "
                                f"Where should I do it instead?",
                       options=_location_options(inp.can_replan), reason="permission", source="fast_path")
    if _NOT_FOUND.search(details):
        options = ([OPTION_OTHER_WAY] if inp.can_replan else [OPTION_SKIP]) + [OPTION_CANCEL]
        return AskUser(question=f"Step {inp.index + 1} ({_label(step)}) uses a program this device does not "
                                f"have: {error}", options=options, reason="not-found", source="fast_path")
    return None


SHOWN_CHANGES = 20


def _held_changes(result: Result, key: str = "needs_approval_for") -> list[dict[str, Any]]:
    """The changes a sandboxed command made that wait for a person (its layer is held on the device); with
    `key="would_change"`, what a file tool's action waiting for approval would change (with its diff)."""
    listed = _payload(result).get(key)
    return [c for c in listed if isinstance(c, dict) and c.get("path")] if isinstance(listed, list) else []


def _changes_question(inp: RecoveryInput, held: list[dict[str, Any]]) -> str:
    """The approval question for held changes: what would change, by which rule, and what approving does."""
    step = inp.step
    command = ""
    if isinstance(step.args.get("cmd"), str):
        command = f" (`{shlex.join([step.args['cmd'], *_argv(step)])}`)"
    lines = []
    for c in held[:SHOWN_CHANGES]:
        moved = f" from {c['from']}" if c.get("from") else ""
        lines.append(f"  - {c.get('kind')} {c['path']}{moved} ({c.get('rule') or 'approval'})")
    if len(held) > SHOWN_CHANGES:
        lines.append(f"  - and {len(held) - SHOWN_CHANGES} more (the step's result lists them all)")
    return (f"Step {inp.index + 1} ({_label(step)}){command} needs your approval: it ran in the sandbox and "
            f"these changes are held, nothing is applied yet:\n" + "\n".join(lines) + "\n"
            "Approve applies exactly these changes without running the command again; deny leaves the files "
            "as they are.")


def _missing_parent_patch(step: PlanStep) -> AutoPatch | None:
    args = step.args
    if step.skill == "write_file" or ("file_path" in args and "content" in args):
        if not args.get("create_parents"):
            return AutoPatch(patched_args={**args, "create_parents": True},
                             note="the parent directory is missing; creating it", source="fast_path")
        return None
    if step.skill in ("shell.run",) and str(args.get("cmd", "")).rsplit("/", 1)[-1] == "mkdir":
        argv = _argv(step)
        if "-p" not in argv and "--parents" not in argv:
            return AutoPatch(patched_args={**args, "argv": ["-p", *argv]},
                             note="the parent directory is missing; mkdir -p creates it", source="fast_path")
    if step.skill in ("shell_execute",) and str(args.get("command", "")).split()[:1] == ["mkdir"]:
        command = str(args["command"])
        if " -p" not in command:
            return AutoPatch(patched_args={**args, "command": "mkdir -p" + command[len("mkdir"):]},
                             note="the parent directory is missing; mkdir -p creates it", source="fast_path")
    return None


# -- the LLM ----------------------------------------------------------------------------------------

RESULT_CHARS = 1200


def build_recovery_messages(inp: RecoveryInput) -> list[Message]:
    """The chat messages asking the LLM for a decision about the failed step of `inp` (its result cut to
    `RESULT_CHARS`)."""
    system = (
        "You are tether's recovery planner. A step of an automation plan failed. Decide what to do, "
        "answering one JSON object:\n"
        '- {"decision":"AUTO_PATCH","patched_args":{...},"note":"..."} to retry the same skill with '
        "corrected arguments (the whole argument object, valid for the skill's schema);\n"
        '- {"decision":"REPLAN","suggestion":"...","constraint":"...","alternative_cwd":null} when the rest '
        "of the plan must change;\n"
        '- {"decision":"ASK_USER","question":"...","options":["...", "..."]} when only a person can decide '
        "(give concrete options).\n"
        "Never propose sudo or leaving the allowed roots; do not repeat arguments that already failed."
    )
    payload = inp.result.result
    text = json.dumps(payload, default=str) if payload is not None else ""
    if len(text) > RESULT_CHARS:
        text = text[:RESULT_CHARS] + "…"
    lines = [f"Request: {inp.request}",
             f"Failed step {inp.index + 1}: skill {inp.step.skill}, args {json.dumps(inp.step.args, default=str)}",
             f"Description: {inp.step.description or '-'}",
             f"Error: {inp.result.error or '-'}"]
    if text:
        lines.append(f"Result: {text}")
    if inp.tool is not None:
        lines.append(f"Skill schema: {compact_schema(inp.tool.input_schema)}")
    if inp.tried_args:
        lines.append("Arguments already tried for this step: "
                     + "; ".join(json.dumps(a, default=str) for a in inp.tried_args))
    if not inp.can_replan:
        lines.append("REPLAN is not available.")
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n".join(lines)}]


def fallback(inp: RecoveryInput, reason: str, source: Source = "fallback") -> AskUser:
    """The ASK_USER recovery gives when nothing else decides: retry, another way (when re-planning is
    allowed), skip or cancel, with `reason` in the question."""
    options = [OPTION_RETRY, *([OPTION_OTHER_WAY] if inp.can_replan else []), OPTION_SKIP, OPTION_CANCEL]
    return AskUser(question=f"Step {inp.index + 1} ({_label(inp.step)}) failed: {inp.result.error or 'no error'}. "
                            f"{reason} What should I do?", options=options, reason=reason, source=source)


def apply_budgets(decision: AutoPatch | Replan | AskUser, inp: RecoveryInput,
                  budgets: Budgets) -> AutoPatch | Replan | AskUser:
    """The decision, or ASK_USER when it would repeat a patch or exceed a budget."""
    if isinstance(decision, AutoPatch):
        if decision.patched_args == inp.step.args or decision.patched_args in inp.tried_args:
            return fallback(inp, "The same fix was proposed again, so I stopped retrying.", "budget")
        if inp.patches_used >= budgets.patches_per_step:
            return fallback(inp, f"I already patched this step {inp.patches_used} time(s) "
                                 f"(the budget is {budgets.patches_per_step}).", "budget")
    if isinstance(decision, Replan):
        if not inp.can_replan:
            return fallback(inp, "Re-planning needs an LLM and none is configured.", "budget")
        if inp.replans_used >= budgets.replans_per_task:
            return fallback(inp, f"I already re-planned {inp.replans_used} time(s) "
                                 f"(the budget is {budgets.replans_per_task}).", "budget")
    return decision


async def recover(inp: RecoveryInput, llm: LLMClient | None,
                  budgets: Budgets | None = None) -> AutoPatch | Replan | AskUser:
    """The decision for a failed step: fast path, else the LLM, else ASK_USER; budgets always apply."""
    budgets = budgets or Budgets()
    decision = fast_path(inp)
    if decision is None:
        if llm is None:
            decision = fallback(inp, "No LLM is configured to work out a fix.")
        else:
            try:
                reply = await llm.complete(build_recovery_messages(inp), json_schema=DECISION_JSON_SCHEMA,
                                           schema_name="recovery")
            except LLMError as exc:
                decision = fallback(inp, f"The LLM could not be asked ({exc}).")
            else:
                try:
                    decision = parse_decision(reply.text, inp.tool)
                except DecisionError as exc:
                    decision = fallback(inp, f"The LLM's recovery reply was not usable ({exc}).")
    return apply_budgets(decision, inp, budgets)


def tool_for(step: PlanStep, tools: Mapping[str | None, list[ToolInfo]]) -> ToolInfo | None:
    """The schema of the skill a step calls, on its device (or the default device, or any device)."""
    order: list[list[ToolInfo]] = []
    if step.device in tools:
        order.append(tools[step.device])
    if None in tools:
        order.append(tools[None])
    order += [v for k, v in tools.items() if k is not None and k != step.device]
    for device_tools in order:
        tool = find_tool(device_tools, step.skill)
        if tool is not None:
            return tool
    return None
