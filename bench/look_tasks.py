"""Tasks that need a look: tether's plan + observe rounds against a one-LLM-call-per-step loop (UFO's way).

    python -m bench.look_tasks        (also part 3 of `python -m bench.tasks`)

Each task can only be done after seeing what is there: the largest log, the report changed today, every
note to back up. The scripted LLM (bench/kit/fake_llm.FakeLLM, a real Chat Completions server) answers the
calls after a look with functions that read the prompt they are sent, so a task only succeeds if what
was seen really reached the LLM: tether's planner gets the observation (compacted results) and plans the
next part, using `{"$ref": ...}` to pass contents between steps and, when it knows the reply before the
steps run, the plan's `answer` (no answer call); the loop gets each result in the next
call and answers one action per call, as bench/tasks.py's anchor loop does (same system prompt style,
same history cut, same device, same client). Counted: LLM calls, prompt tokens (len(text)//4 of the
messages, for both), commands, and success (the files each task must leave, checked).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.kit.task_kit import (
    Json,
    Usage,
    act,
    agent_fakes,
    done,
    make_device,
    no_questions,
    plan_reply,
    run_loop,
    step,
    usage_of,
)
from tether.agent.llm.chat import LLMClient
from tether.agent.run.executor import TaskRunner
from tether.agent.run.task import Task, TaskState

Reply = str | Callable[[Json], str]
DAY = 86_400


def ref(text: str) -> Json:
    return {"$ref": text}


def answered(answer: str, *steps: Json) -> str:
    """A plan whose reply to the user is known when it is made (no answer call after it)."""
    return json.dumps({"steps": list(steps), "answer": answer})


def last_user(body: Json) -> str:
    return str(body["messages"][-1]["content"])


def seen_result(body: Json, step_number: int = 1) -> Any:
    """The result of a step as the LLM was shown it: tether's observation row, or the loop's last result."""
    text = last_user(body)
    if text.startswith("Result: "):
        return json.loads(text[len("Result: "):])["result"]
    for line in text.splitlines():
        if line.startswith(f'{{"step": {step_number},'):
            return json.loads(line)["result"]
    raise AssertionError(f"step {step_number}'s result is not in the prompt:\n{text[:500]}")


@dataclass
class LookScenario:
    name: str
    request: str
    tether: list[Reply]
    loop: list[Reply]
    before: dict[str, str] = field(default_factory=dict)
    mtimes: dict[str, float] = field(default_factory=dict)  # name → seconds before now
    after: dict[str, str | None] = field(default_factory=dict)


def largest_log(w: Path) -> LookScenario:
    logs, report = w / "logs", w / "report.txt"
    sizes = {"app.log": 120, "db.log": 900, "web.log": 400, "cron.log": 60}

    def largest(body: Json) -> str:
        entries = seen_result(body)["entries"]
        return str(logs / max(entries, key=lambda e: e["size"])["name"])

    read = lambda b: step("read_file", {"file_path": largest(b), "max_bytes": 64})  # noqa: E731
    tether: list[Reply] = [
        plan_reply(step("list_dir", {"path": str(logs)}), step("observe", {"note": "which log is largest"})),
        lambda b: answered(f"{Path(largest(b)).name} is the largest; its start is in report.txt.", read(b),
                           step("write_file", {"file_path": str(report), "content": ref("steps.2.result.content")}))]
    loop: list[Reply] = [
        act(step("list_dir", {"path": str(logs)})),
        lambda b: act(read(b)),
        lambda b: act(step("write_file", {"file_path": str(report), "content": seen_result(b)["content"]})),
        done("db.log is the largest; its start is in report.txt.")]
    return LookScenario("the largest log, copy its start", f"copy the start of the largest log in {logs} "
                        f"to {report}", tether, loop,
                        before={f"logs/{n}": n[0] * s for n, s in sizes.items()}, after={"report.txt": "d" * 64})


def report_today(w: Path) -> LookScenario:
    reports = w / "reports"
    ages = {"q1.txt": 90 * DAY, "q2.txt": 30 * DAY, "q3.txt": 600.0, "q4.txt": 10 * DAY}

    def newest(body: Json) -> str:
        entries = seen_result(body)["entries"]
        return str(reports / max(entries, key=lambda e: e["mtime"])["name"])

    tether: list[Reply] = [
        plan_reply(step("list_dir", {"path": str(reports)}), step("observe", {"note": "which changed today"})),
        lambda b: plan_reply(step("read_file", {"file_path": newest(b)})),
        "q3.txt changed today; it reads: report q3."]
    loop: list[Reply] = [act(step("list_dir", {"path": str(reports)})),
                         lambda b: act(step("read_file", {"file_path": newest(b)})),
                         done("q3.txt changed today; it reads: report q3.")]
    return LookScenario("the report changed today", f"open the report in {reports} that was changed today",
                        tether, loop, before={f"reports/{n}": f"report {n[:2]}" for n in ages},
                        mtimes={f"reports/{n}": age for n, age in ages.items()})


def backup_notes(w: Path) -> LookScenario:
    notes, nas = w / "notes", w / "nas"
    files = {"todo.txt": "buy milk", "ideas.txt": "a tether plugin", "log.txt": "ran 5 km"}

    def copy_plan(body: Json) -> str:
        names = sorted(e["name"] for e in seen_result(body)["entries"])
        reads = [step("read_file", {"file_path": str(notes / n)}) for n in names]
        writes = [step("write_file", {"file_path": str(nas / n), "content": ref(f"steps.{2 + i}.result.content"),
                                      "create_parents": True}) for i, n in enumerate(names)]
        return answered(f"Backed up {len(names)} notes to the nas.", *reads, *writes)

    def loop_next(body: Json) -> str:
        """Copy the files one by one: read the next, write what was just read."""
        messages = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
        last = json.loads(messages[-1])["action"]
        listing = json.loads(re.sub(r"^Result: ", "", body["messages"][3]["content"]))["result"]
        names = sorted(e["name"] for e in listing["entries"])
        if last["skill"] == "read_file":
            name = Path(last["args"]["file_path"]).name
            return act(step("write_file", {"file_path": str(nas / name), "content": seen_result(body)["content"],
                                           "create_parents": True}))
        written = {Path(json.loads(m)["action"]["args"]["file_path"]).name for m in messages
                   if json.loads(m).get("action", {}).get("skill") == "write_file"}
        rest = [n for n in names if n not in written]
        if not rest:
            return done("Backed up 3 notes to the nas.")
        return act(step("read_file", {"file_path": str(notes / rest[0])}))

    tether: list[Reply] = [plan_reply(step("list_dir", {"path": str(notes)}), step("observe", {})), copy_plan]
    loop: list[Reply] = [act(step("list_dir", {"path": str(notes)})), *([loop_next] * 7)]
    return LookScenario("back up ~/notes to the nas", f"back up {notes} to {nas}", tether, loop,
                        before={f"notes/{n}": c for n, c in files.items()},
                        after={f"nas/{n}": c for n, c in files.items()})


LOOK_SCENARIOS: list[Callable[[Path], LookScenario]] = [largest_log, report_today, backup_notes]


def set_up(w: Path, scenario: LookScenario) -> None:
    shutil.rmtree(w, ignore_errors=True)
    w.mkdir(parents=True)
    for name, content in scenario.before.items():
        (w / name).parent.mkdir(parents=True, exist_ok=True)
        (w / name).write_text(content)
    now = time.time()
    for name, age in scenario.mtimes.items():
        os.utime(w / name, (now - age, now - age))


def check(w: Path, scenario: LookScenario) -> bool:
    for name, content in scenario.after.items():
        path = w / name
        if not (path.is_dir() if content is None else path.is_file() and path.read_text() == content):
            return False
    return True


@dataclass
class LookRow:
    name: str
    tether: Usage
    loop: Usage
    tether_ok: bool
    loop_ok: bool


async def measure_look_tasks(root: Path) -> list[LookRow]:
    fakes = agent_fakes()
    rows: list[LookRow] = []
    device = make_device(root)
    try:
        computer = await device.computer_manager.get_or_create(None)
        tools = computer.tool_infos()
        async with fakes.FakeLLM() as fake, LLMClient(fake.settings()) as llm:
            for make in LOOK_SCENARIOS:
                w = root / "work" / make.__name__
                scenario = make(w)

                set_up(w, scenario)
                fake.add(*scenario.tether)
                seen = len(fake.requests)
                task = Task(request=scenario.request)
                dispatcher = device.dispatcher(session_id=task.id)
                runner = TaskRunner(lambda _name, d=dispatcher: d, llm, tools={None: tools}, ask=no_questions)
                await runner.run(task)
                tether_ok = task.state is TaskState.DONE and not fake.replies and check(w, scenario)
                fake.replies.clear()
                ours = usage_of(fake.requests[seen:], task.counters.llm_calls, task.counters.prompt_tokens,
                                task.counters.commands, sum(not r.result.ok for r in task.steps))

                set_up(w, scenario)
                fake.add(*scenario.loop)
                seen = len(fake.requests)
                before = (llm.calls, llm.prompt_tokens)
                outcome = await run_loop(llm, device.dispatcher(session_id=f"loop-{make.__name__}"), tools,
                                         scenario.request)
                loop_ok = outcome.answer is not None and not fake.replies and check(w, scenario)
                fake.replies.clear()
                loop = usage_of(fake.requests[seen:], llm.calls - before[0], llm.prompt_tokens - before[1],
                                outcome.commands, outcome.failures)
                rows.append(LookRow(scenario.name, ours, loop, tether_ok, loop_ok))
    finally:
        await device.aclose()
    return rows


def print_look_tasks(rows: list[LookRow]) -> None:
    print("Tasks that need a look: tether (plan, observe, plan the rest, answer) against a one-LLM-call-per-step "
          "loop (UFO's way, the anchor); same device, same client, same scripted LLM")
    head = f"{'task':<34} {'ok':>5} | {'tether calls':>12} {'tokens':>7} | {'loop calls':>10} {'tokens':>7} | " \
           f"{'calls':>6} {'tokens':>7}"
    print(head)
    print("-" * len(head))
    total_t, total_l = Usage(), Usage()
    for row in rows:
        ok = f"{'y' if row.tether_ok else 'n'}/{'y' if row.loop_ok else 'n'}"
        print(f"{row.name:<34} {ok:>5} | {row.tether.calls:>12} {row.tether.prompt_tokens:>7} | "
              f"{row.loop.calls:>10} {row.loop.prompt_tokens:>7} | {row.tether.calls / row.loop.calls:>5.2f}x "
              f"{row.tether.prompt_tokens / row.loop.prompt_tokens:>6.2f}x")
        total_t.merge(row.tether)
        total_l.merge(row.loop)
    print("-" * len(head))
    ok_t, ok_l = sum(r.tether_ok for r in rows), sum(r.loop_ok for r in rows)
    print(f"{'all ' + str(len(rows)) + ' tasks':<34} {f'{ok_t}/{ok_l}':>5} | {total_t.calls:>12} "
          f"{total_t.prompt_tokens:>7} | {total_l.calls:>10} {total_l.prompt_tokens:>7} | "
          f"{total_t.calls / total_l.calls:>5.2f}x {total_t.prompt_tokens / total_l.prompt_tokens:>6.2f}x")
    print(f"success: tether {ok_t}/{len(rows)}, loop {ok_l}/{len(rows)}; calls and tokens: tether / loop (anchor); "
          f"tether's calls by kind: {total_t.kinds()} (p plan incl. observe rounds, a answer: none when "
          "the last plan carried it)")


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="tether-bench-look-") as tmp:
        print_look_tasks(await measure_look_tasks(Path(tmp)))


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
