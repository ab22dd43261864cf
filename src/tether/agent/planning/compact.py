"""Planning for small models (`llm.plan_compact`): a short prompt and a narrow schema built from the request.

A model of a few hundred million parameters copies what it is shown: a full catalogue of skills becomes a
plan calling all of them, a schema's every optional argument becomes a guessed value, and a path becomes a
placeholder. So the compact planner shows and allows only what the request plausibly needs:
- the skills that match the request's words best (`rank_skills`: a cheap lexical match, rarer words counting
  more, a word in the skill's name more than one in its description), a further one only for words the
  ones before it do not match, at most `COMPACT_SKILLS`;
- each skill's required arguments, plus the optional ones the request names (by the argument's name or one
  of its allowed values);
- where the request names absolute paths, a path argument may only be one of them, or (for an action, which
  may create what it names; never for a skill that only looks) a file name the request writes inside one of
  them that looks like a folder (`allowed_paths`; `grounded_problems` checks the same after the reply, for
  servers that do not enforce the schema);
- no graph, observe rounds, `answer` or step descriptions; a step repeating an earlier one exactly is dropped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tether.agent.llm.chat import Message
from tether.agent.planning.plan import Plan
from tether.agent.planning.schema import REF_ARG, compact_schema, strict_schema
from tether.protocol.models import ToolInfo

COMPACT_SKILLS = 3
KEEP_SHARE = 0.5  # a further skill needs this share of the best skill's score on words not matched before
_PATH = re.compile(r"(?<![\w.~/:])(?:~|\.{1,2})?/[^\s'\"`,;()<>\[\]{}]*")
_PATH_ARG = re.compile(r"path|file|dir|folder|source|destination|src|dst|target", re.IGNORECASE)
_WORD = re.compile(r"[a-z0-9]+")


def _stem(word: str) -> str:
    for suffix in ("ing", "ed", "es", "s"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)]
            break
    return word[:6]


def _words(text: str) -> set[str]:
    return {_stem(w) for w in _WORD.findall(text.lower())}


# everyday words for what the tools' names and summaries say otherwise
_SAME = {"remove": "delete", "erase": "delete", "rm": "delete", "show": "read", "view": "read", "display": "read",
         "print": "read", "cat": "read", "open": "read", "create": "write", "save": "write", "store": "write",
         "rename": "move", "ls": "list", "folder": "directory", "exist": "info", "size": "info"}
_SYNONYMS = {_stem(k): _stem(v) for k, v in _SAME.items()}


def _asked(request: str) -> set[str]:
    """The request's words (paths left out: a path is a value to copy, not a word saying what to do), with the
    tools' word for an everyday one added."""
    words = _words(_PATH.sub(" ", request))
    return words | {_SYNONYMS[w] for w in words if w in _SYNONYMS}


def _summary(tool: ToolInfo) -> str:
    """The first sentence of a tool's description: what it does (the rest are caveats)."""
    text = " ".join((tool.description or "").split("\n\n", 1)[0].split())
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]


def request_paths(request: str) -> list[str]:
    """The absolute (or `~`/`./`-relative) paths written in `request`, in order, without trailing punctuation."""
    out: list[str] = []
    for match in _PATH.finditer(request):
        path = match.group(0).rstrip(".:!?")
        if len(path) > 1 and path not in out:
            out.append(path)
    return out


def is_path_argument(name: str) -> bool:
    """Whether an argument of this name holds a path (`file_path`, `path`, `source`, `destination`, `cwd` …)."""
    return bool(_PATH_ARG.search(name)) or name == "cwd"


def rank_skills(request: str, tools: Sequence[ToolInfo], limit: int = COMPACT_SKILLS) -> list[ToolInfo]:
    """At most `limit` of `tools` that the request's words (paths left out) ask for, best first. A request word
    found in a skill's name scores 3, in its description's first sentence 1 (an everyday word also counts as the
    tools' own: remove as delete, show as read …), times the word's rarity among
    `tools` (log(1 + n/df)). The best skill is always offered; each next one only for the request words the
    skills before it do not match, when those score at least `KEEP_SHARE` of the best (a second skill for a
    second thing asked, not a second way of doing the first). With no match at all, the first tool."""
    wanted = _asked(request)
    described = [(_words(t.name.replace(".", " ").replace("_", " ")), _words(_summary(t))) for t in tools]
    df: dict[str, int] = {}
    for name_words, text_words in described:
        for word in name_words | text_words:
            df[word] = df.get(word, 0) + 1
    matches: list[dict[str, float]] = [
        {w: math.log(1 + len(tools) / df[w]) * (3 if w in name_words else 1)
         for w in wanted if w in name_words or w in text_words} for name_words, text_words in described]
    # ties go to the skill whose name the request matches more of (read_file over shell_execute_read for "read")
    order = sorted(range(len(tools)), key=lambda i: (-sum(matches[i].values()),
                                                     -len(described[i][0] & wanted) / max(1, len(described[i][0]))))
    if not order:
        return []
    best = sum(matches[order[0]].values())
    chosen = [order[0]]
    covered = set(matches[order[0]])
    for index in order[1:]:
        if len(chosen) >= limit:
            break
        gain = sum(score for word, score in matches[index].items() if word not in covered)
        if best > 0 and gain >= best * KEEP_SHARE:
            chosen.append(index)
            covered |= set(matches[index])
    return [tools[index] for index in chosen]


def without_repeats(plan: Plan) -> Plan:
    """`plan` without the steps that repeat an earlier step exactly (the same skill, arguments and device): a
    small model often writes its one step twice, and the second then fails (the file already deleted)."""
    seen: list[tuple[str, Any, str | None]] = []
    steps = []
    for step in plan.steps:
        key = (step.skill, step.args, step.device)
        if key in seen:
            continue
        seen.append(key)
        steps.append(step)
    return plan if len(steps) == len(plan.steps) else plan.model_copy(update={"steps": steps})


def _named_in(request_words: set[str], name: str, spec: Mapping[str, Any]) -> bool:
    names = _words(name.replace("_", " "))
    values = {_stem(str(v).lower()) for v in spec.get("enum") or () if isinstance(v, str)}
    return bool(names & request_words) or bool(values & request_words)


_FILE_NAME = re.compile(r"(?<![\w./~-])[\w-]+\.[A-Za-z0-9]{1,8}(?![\w/])")


def allowed_paths(request: str, new_names: bool) -> list[str]:
    """The values a path argument may take for `request`: the paths it writes, and with `new_names` (an action,
    which may create what it names) also each file name the request writes (bare, or the last part of a path)
    inside each of its paths that looks like a folder (no `.` in its last part): "Move /srv/r.pdf into
    /srv/archive" allows /srv/archive/r.pdf. Empty when the request writes no path."""
    paths = request_paths(request)
    if not new_names:
        return paths
    folders = [p.rstrip("/") for p in paths if "." not in p.rstrip("/").rsplit("/", 1)[-1]]
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in paths if p not in folders and p.rstrip("/") not in folders]
    names += _FILE_NAME.findall(_PATH.sub(" ", request))
    out = list(paths)
    for folder in folders:
        out += [f"{folder}/{name}" for name in names if f"{folder}/{name}" not in out]
    return out


def narrow_arguments(tool: ToolInfo, request: str) -> dict[str, Any] | None:
    """The strict schema of `tool`'s arguments that the compact plan offers (see the module docstring), each
    argument also allowed as a `{"$ref": ...}`; None when the tool's arguments cannot be put in strict form."""
    given = tool.input_schema or {}
    props: Mapping[str, Any] = given.get("properties") or {}
    required = set(given.get("required") or ())
    words = _words(_PATH.sub(" ", request))
    kept = {k: v for k, v in props.items() if k in required or _named_in(words, k, v)}
    if not kept:
        return {"type": "object", "properties": {}, "required": [], "additionalProperties": False}
    strict = strict_schema({"type": "object", "properties": kept, "required": [k for k in kept if k in required]})
    if strict is None:
        return None
    paths = request_paths(request)
    out: dict[str, Any] = {}
    for name, spec in strict["properties"].items():
        if paths and is_path_argument(name) and props[name].get("type") == "string":
            grounded = {"type": "string", "enum": allowed_paths(request, tool.tool_type == "action")}
            spec = grounded if name in required else {"anyOf": [grounded, {"type": "null"}]}
        out[name] = {"anyOf": [*spec["anyOf"], REF_ARG]} if "anyOf" in spec else {"anyOf": [spec, REF_ARG]}
    return {**strict, "properties": out}


def compact_plan_schema(tools: Mapping[str, list[str]], skills: Sequence[ToolInfo],
                        request: str) -> tuple[dict[str, Any], bool]:
    """The plan schema of a compact plan: `{"steps": [{"skill", "args"(, "device")}]}`, one branch per skill
    in `skills` (`tools` maps each skill to the devices that have it; `device` only when there are several
    devices). Strict unless a skill's arguments cannot be put in strict form (then any object)."""
    devices = sorted({d for owners in tools.values() for d in owners})
    strict = True
    branches = []
    for tool in skills:
        args = narrow_arguments(tool, request)
        if args is None:
            strict, args = False, {"type": "object"}
        props: dict[str, Any] = {"skill": {"type": "string", "enum": [tool.name]}, "args": args}
        if len(devices) > 1:
            props["device"] = {"type": "string", "enum": tools.get(tool.name) or devices}
        branches.append({"type": "object", "additionalProperties": False, "properties": props,
                         "required": list(props)})
    schema = {"type": "object", "additionalProperties": False, "required": ["steps"],
              "properties": {"steps": {"type": "array", "items": {"anyOf": branches}}}}
    return schema, strict


def compact_messages(request: str, skills: Sequence[ToolInfo], devices: Sequence[str], *,
                     history: Sequence[str] = (), recovery_context: str | None = None) -> list[Message]:
    """The compact planner's system and user messages: the offered skills with their narrowed arguments
    (`history` lines as the full prompt words them)."""
    lines = ["Turn the user's request into a plan: a JSON list of skill calls. Use only these skills, and "
             "copy paths and values exactly as the request writes them.", "", "Skills:"]
    for tool in skills:
        narrowed = narrow_arguments(tool, request) or {}
        shown = {"properties": {k: (tool.input_schema.get("properties") or {}).get(k, {})
                                for k in narrowed.get("properties") or {}},
                 "required": [k for k in (narrowed.get("properties") or {})
                              if k in set(tool.input_schema.get("required") or ())]}
        summary = " ".join((tool.description or "").split("\n\n", 1)[0].split())
        summary = re.split(r"(?<=[.;])\s", summary, maxsplit=1)[0]
        lines.append(f"- {tool.name}: {summary[:160]}")
        lines.append(f"  args: {compact_schema(shown)}")
    device = ', "device": "..."' if len(devices) > 1 else ""
    lines += ["", f'Answer with JSON only: {{"steps": [{{"skill": "...", "args": {{...}}{device}}}]}}']
    if len(devices) > 1:
        lines.append(f"Devices: {', '.join(devices)}.")
    user = [f"Request: {request.strip()}"]
    if history:
        user += ["", "Steps already run (with their results):", *history]
    if recovery_context:
        user += ["", "Recovery context (plan again with this in mind; do not repeat what failed):",
                 recovery_context.strip()]
    return [{"role": "system", "content": "\n".join(lines)}, {"role": "user", "content": "\n".join(user)}]


def grounded_problems(plan: Plan, request: str, tools: Mapping[str, ToolInfo]) -> list[str]:
    """Path arguments of `plan` that the request does not name, where it names any: each a problem saying
    which path the request wrote (a `{"$ref": ...}` is never one)."""
    paths = request_paths(request)
    if not paths:
        return []
    problems = []
    for number, step in enumerate(plan.steps, 1):
        props = (tools[step.skill].input_schema.get("properties") or {}) if step.skill in tools else {}
        for name, value in step.args.items():
            if not isinstance(value, str) or not is_path_argument(name) or props.get(name, {}).get("type") != "string":
                continue
            if value in allowed_paths(request, tools[step.skill].tool_type == "action"):
                continue
            problems.append(f"step {number} ({step.skill}): {name} is {value!r}, a path the request does not "
                            f"name; the request names {', '.join(paths)}: copy the one meant exactly")
    return problems
