"""The planner (seed 004's planSkills): a request in plain words becomes a validated plan of skill calls.

The prompt carries the request, the target devices' profiles and their tools' schemas (compact, each
schema once), the policy constraints, the steps already run and any recovery context. The LLM answers
JSON under `plan_schema` (one branch per skill offered, with that skill's own arguments); the plan is
validated against the devices' tools and, when it has problems, the LLM is asked once more with the
problems listed and at most the first `QUOTE_CHARS` of its reply quoted. A second bad plan is a
`PlanningError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from tether.agent.llm.chat import LLMClient, LLMReply, Message
from tether.agent.planning import compact
from tether.agent.planning.device_view import DeviceLike, DeviceView, as_device_view
from tether.agent.planning.plan import PLAN_JSON_SCHEMA, Plan, PlanError, plan_from_data, validate_plan
from tether.agent.planning.schema import _without_null_options, compact_schema, plan_schema
from tether.errors import AgentError
from tether.protocol.models import ToolInfo
from tether.protocol.profile import DeviceProfile

MAX_ATTEMPTS = 2  # the first plan and one re-ask with its problems
HISTORY_ITEM_CHARS = 600
QUOTE_CHARS = 500  # of a bad reply, quoted back in the re-ask
PROBLEM_CHARS = 300
MAX_PROBLEMS = 12
DEFAULT_POLICY_SUMMARY = (
    "- Never use sudo, su, doas or passwd; never try to gain privileges.\n"
    "- shell.run takes a program in `cmd` and its arguments as a list in `argv`; never a shell string, "
    "no pipes, redirections, `;`, `&&` or `sh -c`.\n"
    "- Every shell.run step sets `cwd` to an absolute directory inside the allowed roots.\n"
    "- Prefer the file tools (write_file, read_file, list_dir, …) over shell commands for files."
)


class PlanningError(AgentError, RuntimeError):
    """The LLM did not produce a valid plan; `problems` lists what was wrong with the last one."""

    def __init__(self, message: str, problems: list[str], raw: str = "", attempts: int = 0) -> None:
        super().__init__(message)
        self.problems = problems
        self.raw = raw
        self.attempts = attempts


@dataclass
class PlanResult:
    """A validated plan and what it took: LLM calls, tokens, attempts, the reply it came from, and the
    problems of the first reply when a re-ask was needed."""

    plan: Plan
    llm_calls: int
    prompt_tokens: int
    attempts: int
    raw: str
    completion_tokens: int = 0
    first_problems: list[str] = field(default_factory=list)


# -- the prompt ------------------------------------------------------------------------------------


def profile_summary(profile: DeviceProfile | None) -> str:
    """One line for the prompt, `; `-separated: what is known of the device (OS, host, cores, memory, GPU,
    tags, capabilities, up to 12 apps, user, home, the roots it may write and read); "no profile" when nothing is."""
    if profile is None:
        return "no profile"
    parts: list[str] = []
    os_bits = " ".join(b for b in (profile.os.platform, profile.os.release) if b)
    if os_bits:
        parts.append(f"os {os_bits}")
    if profile.network.hostname:
        parts.append(f"host {profile.network.hostname}")
    if profile.cpu.cores:
        parts.append(f"{profile.cpu.cores} cores")
    if profile.memory.total_gb:
        parts.append(f"{profile.memory.total_gb:g} GB RAM")
    if profile.gpu.available:
        parts.append(f"GPU {profile.gpu.model or 'yes'}")
    if profile.tags:
        parts.append(f"tags {', '.join(profile.tags)}")
    if profile.capabilities:
        parts.append(f"capabilities {', '.join(profile.capabilities)}")
    if profile.installed_apps:
        apps = profile.installed_apps[:12]
        more = f" (+{len(profile.installed_apps) - len(apps)} more)" if len(profile.installed_apps) > len(apps) else ""
        parts.append(f"apps {', '.join(apps)}{more}")
    if profile.user:
        parts.append(f"user {profile.user}")
    if profile.home:
        parts.append(f"home {profile.home}")
    if profile.write_roots:
        parts.append(f"may write under {', '.join(profile.write_roots)}")
    if profile.read_roots and profile.read_roots != profile.write_roots:
        parts.append(f"may read under {', '.join(profile.read_roots)}")
    return "; ".join(parts) or "no profile"


def _first_paragraph(text: str, limit: int = 240) -> str:
    paragraph = " ".join((text or "").strip().split("\n\n", 1)[0].split())
    return paragraph if len(paragraph) <= limit else paragraph[: limit - 1] + "…"


def _history_line(index: int, item: Any) -> str:
    if isinstance(item, BaseModel):
        item = item.model_dump(mode="json", exclude_none=True)
    text = item if isinstance(item, str) else json.dumps(item, default=str, separators=(",", ":"))
    if len(text) > HISTORY_ITEM_CHARS:
        text = text[:HISTORY_ITEM_CHARS] + "…"
    return f"{index}. {text}"


def build_messages(request: str, devices: Mapping[str, DeviceView], policy_summary: str,
                   history: Sequence[Any] = (), recovery_context: str | None = None, *,
                   graph: bool = True) -> list[Message]:
    """The planner's system and user messages; `graph` False leaves out how to write a graph (ids, needs,
    when), so the plan is a chain of steps."""
    lines = [
        "You are tether's automation planner. Turn the user's request into a plan: a short list of "
        "skill calls that devices run in order" + (", or as a graph where steps can run at the same time" if graph
                                                  else "") + ". Use only "
        "the skills listed below, with arguments that match their schemas (* marks a required argument).",
        "",
        "Policy (steps that break it are refused):",
        policy_summary.strip(),
        "",
        "Devices:",
    ]
    schemas: dict[str, ToolInfo] = {}
    for name, view in devices.items():
        names = ", ".join(t.name for t in view.tools) or "none"
        lines.append(f"- {name}: {profile_summary(view.profile)}; skills: {names}")
        for tool in view.tools:
            schemas.setdefault(tool.name, tool)
    lines += ["", "Skills:"]
    for tool in schemas.values():
        description = _first_paragraph(tool.description)
        lines.append(f"- {tool.name} [{tool.tool_type}]: {description}".rstrip(": "))
        lines.append(f"  args: {compact_schema(tool.input_schema)}")
    several = len(devices) > 1
    lines += [
        "",
        'Answer with one JSON object only: {"steps": [{"skill": "...", "args": {...}, '
        '"description": "what this step does", "device": ' + ('"device name"' if several else "null") + "}]}.",
        "Set \"device\" on every step when more than one device is listed; otherwise leave it null."
        if several else "Leave \"device\" null.",
        "",
        "Using what an earlier step found: an argument may be {\"$ref\": \"steps.N.result.KEY\"}, the value at "
        "KEY in the result of step N (steps count from 1; keys and list indices separated by dots, e.g. "
        "steps.2.result.entries.0.name; steps.N.result alone is the whole result). The whole argument is "
        "replaced; text templates such as {{...}} inside strings are never filled in.",
        "Looking before acting: when the next steps depend on what is found (which file is largest, what a "
        "page or screen shows), plan the steps that look and end the plan with {\"skill\": \"observe\", "
        "\"args\": {\"note\": \"what to look at\"}}; you will be shown their results and plan the rest. "
        "GUI tasks work in such rounds: screenshot, get_ui_tree or browser.act snapshot, then observe, then act "
        "on the labels you saw. Do not observe when the plan can be made now.",
    ]
    if graph:
        lines.append(
            "Steps that do not depend on each other (on different devices above all) run at the same time: give "
            "each step an \"id\" and \"needs\": the ids of the steps it must wait for ([] for none); a step "
            "without needs waits for the step before it. \"when\" runs a step only on success of its needs "
            "(the default), on \"failure\" of one, \"always\", or on a condition {\"ref\": \"steps.ID.result.KEY\", "
            "\"equals\"|\"contains\"|\"matches\": value}. A $ref or condition may only name steps the step needs "
            "(directly or through them): {\"$ref\": \"steps.ID.result.KEY\"} reads a step by id.")
    lines += [
        "When you already know what to tell the user once every step has succeeded (it does not depend on "
        "results you have not seen), add it as \"answer\" beside \"steps\"; otherwise leave it out.",
    ]
    user = [f"Request: {request.strip()}"]
    if history:
        user += ["", "Steps already run (with their results):"]
        user += [_history_line(i, item) for i, item in enumerate(history)]
    if recovery_context:
        user += ["", "Recovery context (plan again with this in mind; do not repeat what failed):",
                 recovery_context.strip()]
    return [{"role": "system", "content": "\n".join(lines)}, {"role": "user", "content": "\n".join(user)}]


# -- parsing ---------------------------------------------------------------------------------------

_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.DOTALL)


def parse_plan_reply(text: str) -> Plan:
    """A plan from the LLM's text: tolerates ``` fences, prose around the JSON and a bare list of steps."""
    candidates: list[str] = [m.group(1) for m in _FENCE.finditer(text)]
    candidates.append(text)
    last_error = "the reply is empty"
    for candidate in candidates:
        data, error = _first_json(candidate.strip())
        if error is not None:
            last_error = error
            continue
        return plan_from_data(data, "the plan")
    raise PlanError(f"the reply is not a JSON plan: {last_error}")


def _first_json(text: str) -> tuple[Any, str | None]:
    if not text:
        return None, "the reply is empty"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        error = str(exc)
    decoder = json.JSONDecoder()
    for match in re.finditer(r"[\[{]", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        # a plan, or a bare list of steps (not a list inside a reply cut off before its end: a step's `needs`)
        if (isinstance(value, dict) and "steps" in value) or (
                isinstance(value, list) and all(isinstance(item, dict) for item in value)):
            return value, None
    return None, error


def _quoted(raw: str) -> str:
    """At most `QUOTE_CHARS` of a reply, to show the LLM what it said without pasting a runaway back."""
    if len(raw) <= QUOTE_CHARS:
        return raw
    return f"{raw[:QUOTE_CHARS]}… [{len(raw) - QUOTE_CHARS} more characters not shown]"


def _re_ask(reply: LLMReply, problems: list[str], max_tokens: int) -> str:
    """What the LLM is told when its plan had problems: what was wrong, briefly, and what to send."""
    lines = []
    if reply.truncated:
        lines.append(f"Your reply ({len(reply.text)} characters) was cut off at the {max_tokens}-token limit "
                     "before the plan ended: answer with a much shorter plan and nothing else.")
    if len(reply.text) > QUOTE_CHARS:
        lines.append(f"Only the first {QUOTE_CHARS} characters of your reply are shown above.")
    shown = [p if len(p) <= PROBLEM_CHARS else p[:PROBLEM_CHARS] + "…" for p in problems[:MAX_PROBLEMS]]
    if len(problems) > MAX_PROBLEMS:
        shown.append(f"… and {len(problems) - MAX_PROBLEMS} more")
    lines += ["That plan has problems:", *(f"- {p}" for p in shown),
              "Reply with the whole corrected plan as one JSON object."]
    return "\n".join(lines)


# -- planning --------------------------------------------------------------------------------------


async def plan_request(llm: LLMClient, request: str, *, devices: Mapping[str, DeviceLike],
                       policy_summary: str = DEFAULT_POLICY_SUMMARY, history: Sequence[Any] = (),
                       recovery_context: str | None = None, stream: bool = False,
                       on_token: Callable[[str], None] | None = None,
                       earlier: Sequence[ToolInfo | None] = (), allow_empty: bool = False,
                       check: Callable[[Plan], list[str]] | None = None) -> PlanResult:
    """Ask the LLM for a plan, validate it, re-ask once with its problems; `PlanningError` if still bad.

    When the plan continues one partly run, `earlier` holds the tools of the steps kept before it (so
    references to them are checked and numbers count on); `allow_empty` accepts "nothing left to do"
    (after an observation). `LLMError` (the LLM unreachable or failing) propagates unchanged. `check`,
    when given, replaces the plan check (a graph's live edit checks the new part against the whole graph).
    """
    views = {name: as_device_view(value) for name, value in devices.items()}
    tools: dict[str | None, list[ToolInfo]] = {name: view.tools for name, view in views.items()}
    graph = llm.settings.plan_graph
    grounding: Callable[[Plan], list[str]] = lambda _plan: []  # noqa: E731
    if llm.settings.plan_compact:
        owners: dict[str, list[str]] = {}
        catalogue: dict[str, ToolInfo] = {}
        for name, view in views.items():
            for tool in view.tools:
                catalogue.setdefault(tool.name, tool)
                owners.setdefault(tool.name, []).append(name)
        skills = compact.rank_skills(request, list(catalogue.values()))
        messages = compact.compact_messages(request, skills, list(views), recovery_context=recovery_context,
                                            history=[_history_line(i, item) for i, item in enumerate(history)])
        schema, strict = compact.compact_plan_schema(owners, skills, request)
        if not history:
            def grounding(plan: Plan) -> list[str]:
                return compact.grounded_problems(plan, request, catalogue)
    else:
        messages = build_messages(request, views, policy_summary, history, recovery_context, graph=graph)
        schema, strict = plan_schema(views, graph=graph)
    calls = prompt_tokens = completion_tokens = 0
    first_problems: list[str] = []
    raw = ""
    problems: list[str] = []
    for attempt in range(1, MAX_ATTEMPTS + 1):
        reply = await llm.complete(messages, json_schema=schema, schema_name="plan", strict=strict,
                                   stream=stream, on_token=on_token, prompt_schema=PLAN_JSON_SCHEMA)
        calls += reply.calls
        prompt_tokens += reply.prompt_tokens
        completion_tokens += reply.completion_tokens
        raw = reply.text
        try:
            plan = _without_null_options(parse_plan_reply(raw), views)
            if llm.settings.plan_compact:
                plan = compact.without_repeats(plan)
        except PlanError as exc:
            problems = [str(exc)]
        else:
            problems = (check(plan) if check is not None else
                        validate_plan(plan, tools, allow_empty=allow_empty, first=len(earlier), earlier=list(earlier)))
            problems = problems or grounding(plan)
            if not problems:
                return PlanResult(plan=plan, llm_calls=calls, prompt_tokens=prompt_tokens, attempts=attempt,
                                  raw=raw, completion_tokens=completion_tokens, first_problems=first_problems)
        if attempt == 1:
            first_problems = list(problems)
        messages = [
            *messages,
            {"role": "assistant", "content": _quoted(raw)},
            {"role": "user", "content": _re_ask(reply, problems, llm.settings.max_tokens)},
        ]
    listing = "\n".join(f"- {p}" for p in problems)
    raise PlanningError(f"the LLM did not produce a valid plan after {MAX_ATTEMPTS} attempts:\n{listing}",
                        problems, raw=raw, attempts=MAX_ATTEMPTS)
