"""`tether run`: plan a request with an LLM (or take a plan file), run it step by step, recover, answer.

Locally (this machine, one process, tasks kept in the state directory's tasks.db), or on a server's
device when a server, a device or requirements are given (see `commands.task`). `tether tasks` and
`tether log` read the same place: the server when one is given, else the local store.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tether.cli import completion as complete
from tether.cli.common import (
    CaOpt,
    ConfigOpt,
    DeviceOpt,
    ExitCode,
    JsonOpt,
    OutputOpt,
    PolicyOpt,
    ServerOpt,
    StateOpt,
    TokenOpt,
    app,
    console,
    fail,
    fail_remote,
    output_mode,
    parse_requires,
)
from tether.cli.guards.root_guard import AllowRootOpt, guard_root
from tether.cli.views.task import EventView, print_log, print_outcome
from tether.errors import ClientError

if TYPE_CHECKING:
    from tether.device.config import DeviceConfig

LocalOpt = Annotated[bool, typer.Option("--local", help="this machine, even when TETHER_SERVER is set")]


@app.command()
def run(request: Annotated[str | None, typer.Argument(help="what to do, in plain words")] = None,
        plan: Annotated[Path | None, typer.Option("--plan", help="a plan file: [{skill, args, description}]")] = None,
        answer: Annotated[list[str] | None, typer.Option("--answer", help="pre-answer questions in order "
                                                                          "(for scripts; else you are asked)")] = None,
        device: DeviceOpt = None,
        require: Annotated[list[str] | None, typer.Option("--require", metavar="KEY=VALUE",
                                                          help="run on a device the server picks by: platform=linux, "
                                                               "tag=NAME, tool=NAME (e.g. tool=browser.act), gpu, "
                                                               "gpu=false; repeat to require several")] = None,
        also: Annotated[list[str] | None, typer.Option("--also", metavar="DEVICE",
                                                       help="another device the plan may use (its steps name it); "
                                                            "repeat for several")] = None,
        server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None, local: LocalOpt = False,
        config: ConfigOpt = None, policy: PolicyOpt = None, state_dir: StateOpt = None,
        confirm: Annotated[bool, typer.Option("--confirm", help="show each plan and ask before it runs")] = False,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="plan (or check --plan), show the plan and "
                                                                "run nothing; exit 1 if it has problems")] = False,
        allow_root: AllowRootOpt = False,
        ) -> None:
    """Plan and run a task with live progress; questions are asked in the terminal.

    On this machine by default. With --server (or TETHER_SERVER), --device or
    --require, the task runs on a server's device and is followed here. Ctrl-C
    detaches: the task goes on (`tether log TASK --follow` follows it again).
    A question with no terminal and no --answer left leaves the task waiting
    for `tether answer TASK ANSWER` or `tether approve TASK` (exit code 3).
    Exit code 0 when the task is done, 1 when it failed or was cancelled.
    """
    from tether.agent.llm.settings import how_to_configure, resolve_llm_settings
    from tether.agent.planning.plan import PlanError, load_plan_file

    if not request and not plan:
        fail("give a request in plain words, or --plan FILE")
    remote = not local and bool(server or device or require or also)
    if local and (device or require or also):
        fail("--local runs on this machine; --device, --require and --also name a server's devices")
    if remote and (config or policy or state_dir):
        fail("--config, --policy and --state-dir are for a task on this machine; on a server's device its own "
             "`tether device` settings apply (or pass --local)")
    given = None
    if plan is not None:
        try:
            given = load_plan_file(plan)
        except PlanError as exc:
            fail(str(exc))
        if not given.steps:  # never sent to an LLM as "run the plan in FILE"
            fail(f"{plan}: the plan has no steps")
    text = request or f"run the plan in {plan}"
    if remote:
        from tether.cli.commands.tasks.task import connect, run_remote

        try:
            requires = parse_requires(list(require or [])) if require else None
        except ValueError as exc:
            fail(str(exc))
        steps = [s.model_dump(mode="json") for s in given.steps] if given is not None else None
        if dry_run:  # --- tether run --dry-run on a server (engineer C): nothing runs, nothing is stored
            from tether.cli.views.plan_preview import dry_run_remote

            with connect(server, token, ca_file) as client:
                raise typer.Exit(dry_run_remote(client, text, steps, device, requires, list(also or [])))
        with connect(server, token, ca_file) as client:
            if steps is not None:  # a plan naming a skill no device has is a usage error: no task is created
                _refuse_unknown_skills(_remote_problems(client, text, steps, device, requires, list(also or [])))
            code = run_remote(client, text, steps, device, requires, list(answer or []), devices=list(also or []),
                              confirm="always" if confirm else None)
        raise typer.Exit(code)
    try:
        settings = resolve_llm_settings(config)  # the same file's llm: section (the environment wins)
        if config is None:
            from tether.device.config import config_file

            config_file(None)  # $TETHER_CONFIG naming a missing file is an error, with or without an LLM
    except ValueError as exc:
        fail(str(exc))
    if given is None and settings is None:
        fail("no LLM is configured, so a request cannot be planned.\n" + how_to_configure())
    from tether.cli.basics import load_config
    from tether.cli.guards.state_lock import device_state, holding_state_dir

    cfg = load_config(config)  # read once: the root guard, the state directory and the device
    if dry_run:  # --- tether run --dry-run (engineer C): nothing runs, nothing is stored
        from tether.cli.views.plan_preview import dry_run_local

        # its device reads the state directory (kept grants, the sandbox probe) and starts external MCP servers
        with holding_state_dir(device_state(cfg, state_dir), "tether run --dry-run"):
            code = asyncio.run(dry_run_local(text, given, settings, cfg, policy, state_dir))
        raise typer.Exit(code)
    guard_root(cfg, allow_root, "tether run")  # a device in this process (tether.device.root)

    with holding_state_dir(device_state(cfg, state_dir), "tether run"):  # one process per state directory
        code = asyncio.run(_run(text, given, settings, cfg, policy, state_dir, list(answer or []),
                                confirm="always" if confirm else "never"))
    raise typer.Exit(code)


class _UnknownSkills(ClientError):
    """A plan names skills the device does not have (`problems`: validate_plan's words for each)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _refuse_unknown_skills(problems: list[str]) -> None:
    """Fail with `ExitCode.USAGE` when a plan's problems include a skill no device offers (a plan file
    that names a tool that does not exist is a bad plan file, like one that does not parse)."""
    unknown = [p for p in problems if "unknown skill" in p]
    if unknown:
        listed = "\n".join(f"- {p}" for p in unknown)
        fail(f"the plan names a skill that does not exist (no task was created):\n{listed}", ExitCode.USAGE)


def _remote_problems(client: Any, text: str, steps: list[dict[str, Any]], device: str | None,
                     requires: dict[str, Any] | None, also: list[str]) -> list[str]:
    """The server's check of a given plan (POST /tasks/dry-run: nothing runs, nothing is stored); none when
    the check itself is refused (an unknown or offline device, a missing scope): creating the task then
    fails with the server's own words for that."""
    from tether.client.rest import RemoteError

    try:
        found = client.dry_run_task(text, plan=steps, device=device, requires=requires, devices=also)
    except RemoteError:
        return []
    return [str(p) for p in found.get("problems") or []]


async def _run(request: str, plan: Any, settings: Any, config: DeviceConfig, policy: Path | None,
               state_dir: Path | None, answers: list[str], confirm: str = "never") -> int:
    from tether.agent.llm.chat import LLMClient
    from tether.agent.run.executor import DEFAULT_DEVICE_NAME, TaskRunner
    from tether.agent.run.replies import Unanswered
    from tether.agent.run.task import Task, TaskEvent, TaskState
    from tether.agent.tasks.store import SaveSoon
    from tether.cli.local.tasks import run_locks, terminal_ask
    from tether.device.local import open_local_device
    from tether.device.probe import collect_profile
    from tether.protocol.models import Command

    out = console()
    llm = LLMClient(settings) if settings is not None else None
    store = _local_store(state_dir)
    task = Task(request=request, plan=plan, confirm=confirm)

    from tether.cli.views.spinner import Spinner

    spinner = Spinner()  # a status line while the LLM plans or a step runs, on a terminal only
    view = EventView(out, spinner=spinner, mcp_questions_asked_here=sys.stdin.isatty())  # as cli_hooks decides

    saver = SaveSoon(store)  # the log survives a crash of this process, step by step

    def show(event: TaskEvent) -> None:
        saver.on_event(task, event)
        view(event.kind, event.data)

    ask = terminal_ask(out, answers)  # the question itself was shown with its event
    problem = None
    refused: list[str] | None = None  # the plan's unknown skills: the task is never stored
    run_lock = run_locks(state_dir).held(task.id)
    run_lock.__enter__()  # held while this process runs the task: if it dies, the next start says so
    try:
        from tether.cli.local.mcp_hooks import cli_hooks

        # an external MCP server's question is asked at this terminal, its sampling uses this LLM
        async with open_local_device(config, policy_path=policy, state_dir=state_dir,
                                     mcp_hooks=cli_hooks(llm), lock_state_dir=False) as device:  # run holds it
            computer = await device.computer_manager.get_or_create(None)
            if plan is not None:  # an unknown skill is a bad plan file: exit 2, and no task is stored
                from tether.agent.planning.plan import validate_plan

                unknown = [p for p in validate_plan(plan, {None: computer.tool_infos()}) if "unknown skill" in p]
                if unknown:
                    raise _UnknownSkills(unknown)
            dispatcher = device.dispatcher(session_id=task.id)
            profiles = {DEFAULT_DEVICE_NAME: await collect_profile(device)} if llm is not None else {}
            runner = TaskRunner(lambda _device: dispatcher, llm, tools={None: computer.tool_infos()},
                                ask=ask, on_event=show, profiles=profiles, stream_planning=spinner.enabled)
            out.print(f"task {task.id}")
            try:
                await runner.run(task)
            finally:  # the task's session ends with it: the device drops its private /tmp (`end_session`)
                await dispatcher.execute_commands([Command(tool_name="end_session")], timeout=30)
    except Unanswered:
        task.error = "the question was left unanswered (no terminal to ask and no --answer left)"
    except _UnknownSkills as exc:
        refused = exc.problems
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc)
        task.error = task.error or problem
    finally:
        await spinner.aclose()
        if refused is None:
            if not task.state.terminal:  # whatever stopped it, the task does not stay 'running'
                task.transition(TaskState.CANCELLED if problem is None and task.error else TaskState.FAILED,
                                error=task.error or "stopped")
            store.save(task)
        store.close()
        run_lock.__exit__(None, None, None)
        if llm is not None:
            await llm.close()
    if refused is not None:
        _refuse_unknown_skills(refused)
    print_outcome(out, task.state.value, task.answer, task.error, streamed=view.streamed)
    if _journaled(state_dir, task.id):  # the hint only where there is something to put back
        out.print(f"[dim]its file changes can be undone with: tether undo {task.id}"
                  f"{' --state-dir ' + str(state_dir) if state_dir else ''}[/dim]")
    return 0 if task.state is TaskState.DONE else 1


def _journaled(state_dir: Path | None, session_id: str) -> bool:
    """Whether the session (a local task's id) journaled a file change not yet put back."""
    from tether.tools.context import default_state_dir
    from tether.tools.journal import UndoJournal

    entries = UndoJournal(Path(state_dir or default_state_dir())).entries(session_id)
    return any(e["undone"] is None for e in entries)


@app.command()
def tasks(state_dir: StateOpt = None, as_json: JsonOpt = False, output: OutputOpt = None,
          limit: Annotated[int, typer.Option(min=1, help="how many, newest first")] = 50,
          state: Annotated[str | None, typer.Option("--state", help="only tasks in this state "
                                                                    "(e.g. waiting_for_user)")] = None,
          server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None, local: LocalOpt = False) -> None:
    """List tasks newest first with their state: the server's with --server (or TETHER_SERVER), else this
    machine's."""
    from tether.cli.commands.tasks.task import connect, print_tasks
    from tether.client.rest import RemoteError

    as_json, wide = output_mode(output, as_json)
    if server and not local:
        try:
            with connect(server, token, ca_file) as remote:
                rows = remote.tasks(limit, state)
        except RemoteError as exc:
            fail_remote(exc, ExitCode.FAILED)
        print_tasks(rows, as_json, f" on {remote.base_url}", wide)
        return
    from tether.agent.run.task import TaskState

    if state is not None and state not in {s.value for s in TaskState}:  # as the server's 422: never "no tasks"
        fail(f"--state must be one of {', '.join(s.value for s in TaskState)}, not {state!r}")
    store = _local_store(state_dir)
    try:
        rows = store.list(limit, state)
    finally:
        store.close()
    print_tasks(rows, as_json, "", wide)


@app.command()
def log(task_id: Annotated[str, typer.Argument(help="a task id (or a unique prefix of one)",
                                              autocompletion=complete.tasks)],
        state_dir: StateOpt = None, as_json: JsonOpt = False,
        follow: Annotated[bool, typer.Option("--follow", "-f", help="a server's task: print its events live "
                                                                     "until it ends")] = False,
        server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None, local: LocalOpt = False) -> None:
    """Show a task's plan, every step with its command and result, decisions, questions and answer: the
    server's task with --server (or TETHER_SERVER), else this machine's."""
    from tether.cli.commands.tasks.task import connect, remote_log

    if server and not local:
        with connect(server, token, ca_file) as remote:
            raise typer.Exit(remote_log(remote, task_id, as_json, follow))
    if follow:
        fail("--follow follows a task on a server (give --server or set TETHER_SERVER); a task on this machine "
             "runs in the terminal that started it")
    store = _local_store(state_dir)
    try:
        task = store.get(task_id)
    finally:
        store.close()
    if task is None:
        fail(f"no task '{task_id}' (or the prefix matches several); 'tether tasks' lists them", code=1)
    if as_json:
        typer.echo(task.model_dump_json(indent=2))
        return
    print_log(console(), task)


def _local_store(state_dir: Path | None) -> Any:
    from tether.cli.local.tasks import open_local_store

    return open_local_store(state_dir)
