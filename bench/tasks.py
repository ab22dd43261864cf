"""Tasks: LLM calls and prompt tokens per task against a one-call-per-step loop, and the time tether adds per step.

    python -m bench.tasks [N]

Part 1, LLM usage. Five fixed tasks run on a real local device (built-in shell, files and system tools,
in a temporary folder) against `bench/kit/fake_llm.FakeLLM`, a real Chat Completions server on 127.0.0.1
with scripted replies: a 3-step happy path; two steps that fail with a missing parent directory
(recovered by the fast path, no LLM); a wrong file name the LLM patches (AUTO_PATCH, twice: the same
mistake sits in two steps); a missing file that makes the LLM re-plan (REPLAN); an 8-step plan.
tether runs each as `tether run` does (TaskRunner: plan, run, recover, streamed answer).
Anchor: a naive one-call-per-step agent loop (ReAct style, written here) on the same tasks, the same
device and the same LLM client: each call sends the system prompt (the policy and the same compact
skill list tether's planner sends), the request and the whole history of actions and results
(each result cut to 600 characters, as tether's planner cuts its history), and gets back the next
action or "done" with the answer; a failure is fed back in the next call. The FakeLLM is scripted so
that the loop takes the same actions. Both count through `LLMClient` (the FakeLLM reports
len(text)//4 of the messages as prompt tokens, so the count is the same for both); every scripted
reply must be used up, every task must end done, and the files each task makes are checked.

Part 3, tasks that need a look (bench/look_tasks.py): plan + observe rounds against the same loop.

Part 2, time tether adds per step. Given plans (no LLM, `llm=None`, as `tether run --plan`) of
STEPS_PER_TASK `read_file` steps on a tiny file (the cheapest built-in plan skill) through TaskRunner,
against the anchor: the same commands sent straight through the same dispatcher
(`execute_commands([Command(...)])` in a loop). Per step: the time from one step's start to the
next's. Also on record: the whole task's time divided by its steps (plan validation, events, the
summary answer included), and TaskRunner with the task saved to `tasks.db` on the events
`tether run` saves on. Rounds of all rows are interleaved (order alternating) so machine noise
hits them alike. N is the number of steps measured per row (default 4000).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench._stats import summary
from bench.kit.task_kit import (  # noqa: F401 (what the task benchmarks share; some re-exported)
    KIND_ORDER,
    LOOP_JSON_SCHEMA,
    LOOP_MAX_CALLS,
    LOOP_RESULT_CHARS,
    Json,
    LoopOutcome,
    Usage,
    act,
    agent_fakes,
    done,
    first_paragraph,
    kind_of,
    listing,
    loop_system_prompt,
    make_device,
    mkdir,
    no_questions,
    observation,
    plan_reply,
    read,
    run_loop,
    step,
    usage_of,
    write,
)
from tether.agent.llm.chat import LLMClient
from tether.agent.planning.plan import Plan, PlanStep
from tether.agent.run.executor import TaskRunner
from tether.agent.run.task import Budgets, Task, TaskEvent, TaskState
from tether.agent.tasks.store import SaveSoon, TaskStore
from tether.protocol.dispatcher import BasicCommandDispatcher
from tether.protocol.models import Command, ToolInfo

STEPS_PER_TASK = 20
WARMUP_ROUNDS = 3



# ---------------------------------------------------------------------------------------------- the tasks
# Each scenario, given its work folder, gives the request, the files present before, tether's scripted
# replies (plan, recovery decisions, answer), the loop's scripted replies (one action per call, then
# done), and the files that must exist afterwards.


@dataclass
class Scenario:
    name: str
    request: str
    tether: list[str]
    loop: list[str]
    before: dict[str, str] = field(default_factory=dict)
    after: dict[str, str | None] = field(default_factory=dict)  # path → content (None: a directory)


def happy(w: Path) -> Scenario:
    steps = [mkdir(w / "demo", w), write(w / "demo" / "hello.txt", "hello world"), listing(w / "demo")]
    answer = "I created the folder demo with hello.txt in it; demo now holds hello.txt (11 bytes)."
    return Scenario("happy path, 3 steps", f"create a folder demo in {w} with hello.txt saying hello world, "
                    "then show me what is in it", [plan_reply(*steps), answer],
                    [*(act(s) for s in steps), done(answer)],
                    after={"demo": None, "demo/hello.txt": "hello world"})


def missing_parents(w: Path) -> Scenario:
    steps = [mkdir(w / "build" / "out", w), write(w / "logs" / "2024" / "run.txt", "started"),
             listing(w / "build")]
    fixed = [mkdir(w / "build" / "out", w, "-p"), write(w / "logs" / "2024" / "run.txt", "started",
                                                         create_parents=True)]
    answer = "I created build/out and logs/2024/run.txt; build now holds out."
    return Scenario("2 missing parents, fast path", f"in {w} create build/out, write 'started' to "
                    "logs/2024/run.txt and list build", [plan_reply(*steps), answer],
                    [act(steps[0]), act(fixed[0]), act(steps[1]), act(fixed[1]), act(steps[2]), done(answer)],
                    after={"build/out": None, "logs/2024/run.txt": "started"})


def llm_patch(w: Path) -> Scenario:
    wrong, right, done_name = w / "note.txt", w / "notes.txt", w / "read-notes.txt"
    steps = [read(wrong), step("move_file", {"source": str(wrong), "destination": str(done_name)},
                               "mark the note as read")]
    patches = [json.dumps({"decision": "AUTO_PATCH", "patched_args": {"file_path": str(right)},
                           "note": "the file is notes.txt"}),
               json.dumps({"decision": "AUTO_PATCH", "patched_args": {"source": str(right),
                                                                       "destination": str(done_name)},
                           "note": "the file is notes.txt"})]
    answer = "Your note says: buy milk. I renamed it to read-notes.txt."
    return Scenario("wrong name, LLM AUTO_PATCH x2", f"read my note in {w}, then rename it to read-notes.txt",
                    [plan_reply(*steps), patches[0], patches[1], answer],
                    [act(steps[0]), act(read(right)),
                     act(step("move_file", {"source": str(right), "destination": str(done_name)})), done(answer)],
                    before={"notes.txt": "buy milk"}, after={"read-notes.txt": "buy milk"})


def replan(w: Path) -> Scenario:
    proj = w / "proj"
    first = [mkdir(proj, w), read(proj / "app.cfg"), write(proj / "app.cfg.bak", "copy of the config")]
    decision = json.dumps({"decision": "REPLAN", "suggestion": "create the config instead of reading it",
                           "constraint": "do not read files that do not exist", "alternative_cwd": None})
    second = [write(proj / "app.cfg", "debug = false\n"), read(proj / "app.cfg")]
    answer = "proj did not have a config, so I created proj/app.cfg with debug = false."
    return Scenario("missing file, LLM REPLAN", f"set up a project proj in {w} with its config app.cfg",
                    [plan_reply(*first), decision, plan_reply(*second), answer],
                    [act(first[0]), act(first[1]), act(second[0]), act(second[1]), done(answer)],
                    after={"proj/app.cfg": "debug = false\n"})


def long_plan(w: Path) -> Scenario:
    app = w / "app"
    files = {"README.md": "# app\n", "pyproject.toml": "[project]\nname = \"app\"\nversion = \"0.1.0\"\n",
             "src/app/__init__.py": "", "src/app/main.py": "def main() -> None:\n    print('hello')\n",
             "tests/test_main.py": "from app.main import main\n\n\ndef test_main() -> None:\n    main()\n"}
    steps = [step("shell.run", {"cmd": "mkdir", "argv": ["-p", str(app / "src" / "app"), str(app / "tests")],
                                "cwd": str(w)}, "create the folders"),
             *(write(app / name, content) for name, content in files.items()),
             listing(app), listing(app / "src" / "app")]
    answer = "I scaffolded the Python project app: README, pyproject.toml, src/app with main.py, and a test."
    return Scenario("8-step plan", f"scaffold a small Python project app in {w} with a README, a pyproject, "
                    "a main module and a test, then show its layout", [plan_reply(*steps), answer],
                    [*(act(s) for s in steps), done(answer)], after={f"app/{k}": v for k, v in files.items()})


SCENARIOS: list[Callable[[Path], Scenario]] = [happy, missing_parents, llm_patch, replan, long_plan]


def prepare(w: Path, scenario: Scenario) -> None:
    shutil.rmtree(w, ignore_errors=True)
    w.mkdir(parents=True)
    for name, content in scenario.before.items():
        (w / name).write_text(content)


def check_files(w: Path, scenario: Scenario, who: str) -> None:
    for name, content in scenario.after.items():
        path = w / name
        ok = path.is_dir() if content is None else path.is_file() and path.read_text() == content
        if not ok:
            raise AssertionError(f"{scenario.name}: {who} did not leave {path} as expected")



# ---------------------------------------------------------------------------------------------- part 1

@dataclass
class TaskRow:
    name: str
    tether: Usage
    loop: Usage


async def measure_tasks(root: Path) -> tuple[list[TaskRow], int]:
    """Run every scenario with tether and with the loop: their LLM usage, and how many tools the device has."""
    fakes = agent_fakes()
    rows: list[TaskRow] = []
    device = make_device(root)
    try:
        computer = await device.computer_manager.get_or_create(None)
        tools = computer.tool_infos()
        async with fakes.FakeLLM() as fake, LLMClient(fake.settings()) as llm:
            for make in SCENARIOS:
                w = root / "work" / make.__name__
                scenario = make(w)

                prepare(w, scenario)
                fake.add(*scenario.tether)
                seen = len(fake.requests)
                task = Task(request=scenario.request)
                dispatcher = device.dispatcher(session_id=task.id)
                runner = TaskRunner(lambda _name, d=dispatcher: d, llm, tools={None: tools}, ask=no_questions)
                await runner.run(task)
                if task.state is not TaskState.DONE or fake.replies:
                    raise AssertionError(f"{scenario.name}: tether ended {task.state.value} ({task.error}) with "
                                         f"{len(fake.replies)} scripted replies unused")
                check_files(w, scenario, "tether")
                ours = usage_of(fake.requests[seen:], task.counters.llm_calls, task.counters.prompt_tokens,
                                task.counters.commands, sum(not r.result.ok for r in task.steps))

                prepare(w, scenario)
                fake.add(*scenario.loop)
                seen = len(fake.requests)
                before = (llm.calls, llm.prompt_tokens)
                outcome = await run_loop(llm, device.dispatcher(session_id=f"loop-{make.__name__}"), tools,
                                         scenario.request)
                if outcome.answer is None or fake.replies:
                    raise AssertionError(f"{scenario.name}: the loop did not finish on its script "
                                         f"({len(fake.replies)} replies unused)")
                check_files(w, scenario, "the loop")
                loop = usage_of(fake.requests[seen:], llm.calls - before[0], llm.prompt_tokens - before[1],
                                outcome.commands, outcome.failures)
                rows.append(TaskRow(scenario.name, ours, loop))
    finally:
        await device.aclose()
    return rows, len(tools)


def task_line(name: str, t: Usage, lp: Usage) -> str:
    return (f"{name:<30} {t.commands:>2}/{lp.commands:<2} {t.failures:>2}/{lp.failures:<1} | "
            f"{t.calls:>2} {'(' + t.kinds() + ')':<12} {t.prompt_tokens:>6} | {lp.calls:>5} {lp.prompt_tokens:>6} | "
            f"{t.calls / lp.calls:>6.2f}x {t.prompt_tokens / lp.prompt_tokens:>6.2f}x")


def print_tasks(rows: list[TaskRow], tools: int) -> None:
    print(f"LLM usage per task: tether (plan, recover, answer) against a one-call-per-step loop (anchor); same "
          f"device ({tools} tools), same client; FakeLLM prompt tokens = len(text)//4")
    head = (f"{'task':<30} {'cmds':>5} {'fail':>4} | {'tether calls':<15} {'tokens':>6} | {'loop':>5} {'tokens':>6} "
            f"| {'calls':>7} {'tokens':>7}")
    print(head)
    print("-" * len(head))
    total_t, total_l = Usage(), Usage()
    for row in rows:
        print(task_line(row.name, row.tether, row.loop))
        total_t.merge(row.tether)
        total_l.merge(row.loop)
    print("-" * len(head))
    print(task_line(f"all {len(rows)} tasks", total_t, total_l))
    print("cmds, fail: commands sent and failed, tether/loop; calls by kind: p plan (re-plans too), r recovery, "
          "a answer; last two columns: tether / loop (the anchor)")
    spent = ", ".join(f"{kind} {total_t.kind_tokens[kind]} in {total_t.kind_calls[kind]} calls "
                      f"({total_t.kind_tokens[kind] // total_t.kind_calls[kind]} each)"
                      for kind in KIND_ORDER if kind in total_t.kind_calls)
    print(f"tether's prompt tokens by kind: {spent}; the loop's: {total_l.prompt_tokens // total_l.calls} per call "
          f"on average")


# ---------------------------------------------------------------------------------------------- part 2

@dataclass
class Overhead:
    direct: list[float] = field(default_factory=list)
    runner: list[float] = field(default_factory=list)
    runner_task: list[float] = field(default_factory=list)
    stored: list[float] = field(default_factory=list)
    stored_task: list[float] = field(default_factory=list)


def deltas(stamps: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(stamps)]


async def direct_round(dispatcher: BasicCommandDispatcher, args: Json, k: int) -> list[float]:
    stamps = []
    for _ in range(k):
        stamps.append(time.perf_counter())
        [result] = await dispatcher.execute_commands([Command(tool_name="read_file", parameters=dict(args))])
        if not result.ok:
            raise AssertionError(f"read_file failed: {result.error}")
    stamps.append(time.perf_counter())
    return deltas(stamps)


async def runner_round(dispatcher: BasicCommandDispatcher, tools: list[ToolInfo], plan: Plan,
                       store: TaskStore | None) -> tuple[list[float], float]:
    """One given-plan task through TaskRunner: the step-start-to-step-start times, and the whole task's time."""
    task = Task(request="read the file again and again", plan=plan.model_copy(deep=True))
    stamps: list[float] = []
    saver = SaveSoon(store) if store is not None else None  # as `tether run` saves

    def on_event(event: TaskEvent) -> None:
        if event.kind == "step_started":
            stamps.append(time.perf_counter())
        if saver is not None:
            saver.on_event(task, event)

    runner = TaskRunner(lambda _name: dispatcher, None, tools={None: tools}, ask=no_questions, on_event=on_event,
                        budgets=Budgets(total_steps=len(plan.steps)))
    t0 = time.perf_counter()
    await runner.run(task)
    total = time.perf_counter() - t0
    if task.state is not TaskState.DONE or task.cursor != len(plan.steps):
        raise AssertionError(f"the given plan ended {task.state.value}: {task.error}")
    if store is not None:
        store.save(task)  # `tether run` saves once more at the end
    return deltas(stamps), total / len(plan.steps)


async def measure_overhead(root: Path, n: int, k: int = STEPS_PER_TASK) -> Overhead:
    """N steps per row, in tasks of k read_file steps, interleaved with N direct calls."""
    target = root / "overhead" / "small.txt"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("tiny")
    args = {"file_path": str(target)}
    plan = Plan(steps=[PlanStep(skill="read_file", args=args, description="read the small file")] * k)
    rounds = max(1, n // k)
    out = Overhead()
    device = make_device(root)
    store = TaskStore(root / "state" / "tasks.db")
    try:
        computer = await device.computer_manager.get_or_create(None)
        tools = computer.tool_infos()
        dispatcher = device.dispatcher(session_id="bench-overhead")
        for i in range(WARMUP_ROUNDS + rounds):
            keep = i >= WARMUP_ROUNDS
            order = [0, 1, 2] if i % 2 == 0 else [2, 1, 0]
            for which in order:
                if which == 0:
                    samples = await direct_round(dispatcher, args, k)
                    if keep:
                        out.direct += samples
                else:
                    with_store = which == 2
                    steps, per_step = await runner_round(dispatcher, tools, plan, store if with_store else None)
                    if keep:
                        (out.stored if with_store else out.runner).extend(steps)
                        (out.stored_task if with_store else out.runner_task).append(per_step)
    finally:
        store.close()
        await device.aclose()
    return out


def print_overhead(o: Overhead, k: int) -> None:
    print(f"time tether adds per step: given plans of {k} read_file steps through TaskRunner (llm=None), "
          f"against the same commands straight through the same dispatcher; interleaved rounds")
    base = summary("anchor: dispatcher.execute_commands, per step", o.direct)
    row = summary("TaskRunner: step start to next step start", o.runner)
    task = summary("TaskRunner: task time / steps (n: tasks)", o.runner_task)
    stored = summary("+ tasks.db saves as `tether run`: per step", o.stored)
    stored_task = summary("+ tasks.db saves: task time / steps", o.stored_task)
    print(f"tether adds p50 {row['p50_us'] - base['p50_us']:.0f} us per step over the dispatcher "
          f"(ratio to anchor p50 {row['p50_us'] / base['p50_us']:.2f}x); per step of the whole task "
          f"{task['p50_us'] - base['p50_us']:.0f} us ({task['p50_us'] / base['p50_us']:.2f}x)")
    print(f"with the task saved to tasks.db as `tether run` saves it: {stored['p50_us'] - base['p50_us']:.0f} us "
          f"per step ({stored['p50_us'] / base['p50_us']:.2f}x), per step of the whole task "
          f"{stored_task['p50_us'] - base['p50_us']:.0f} us ({stored_task['p50_us'] / base['p50_us']:.2f}x)")


# ---------------------------------------------------------------------------------------------- main

async def main(n: int) -> None:
    with tempfile.TemporaryDirectory(prefix="tether-bench-tasks-") as tmp:
        root = Path(tmp)
        rows, tools = await measure_tasks(root / "llm")
        print_tasks(rows, tools)
        print()
        overhead = await measure_overhead(root / "steps", n)
        print_overhead(overhead, STEPS_PER_TASK)
        print()
        from bench.look_tasks import measure_look_tasks, print_look_tasks  # part 3: tasks that need a look

        print_look_tasks(await measure_look_tasks(root / "look"))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 4000))
