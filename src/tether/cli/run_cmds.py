"""`tether run`: plan a request with an LLM (or take a plan file), run it step by step, recover, answer.

This release runs tasks in local mode, on this machine in one process; tasks on a server's
devices (durable, resumable, answerable through the API) are the next step of issue 4.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from tether.cli.common import ConfigOpt, JsonOpt, PolicyOpt, StateOpt, app, console, fail

_SAVE_ON = frozenset({"plan", "step_finished", "decision", "question", "user_answer", "state", "answer"})


@app.command()
def run(request: Annotated[str | None, typer.Argument(help="what to do, in plain words")] = None,
        plan: Annotated[Path | None, typer.Option("--plan", help="a plan file: [{skill, args, description}]")] = None,
        config: ConfigOpt = None, policy: PolicyOpt = None, state_dir: StateOpt = None,
        answer: Annotated[list[str] | None, typer.Option("--answer", help="pre-answer questions in order "
                                                                          "(for scripts; else you are asked)")] = None,
        ) -> None:
    """Plan and run a task on this machine, with live progress; questions are asked in the terminal."""
    from tether.agent.llm import LLMSettings, how_to_configure
    from tether.agent.plan import PlanError, load_plan_file

    if not request and not plan:
        fail("give a request in plain words, or --plan FILE")
    given = None
    if plan is not None:
        try:
            given = load_plan_file(plan)
        except PlanError as exc:
            fail(str(exc))
    settings = LLMSettings.from_env()
    if given is None and settings is None:
        fail("no LLM is configured, so a request cannot be planned.\n" + how_to_configure())
    code = asyncio.run(_run(request or f"run the plan in {plan}", given, settings, config, policy, state_dir,
                            list(answer or [])))
    raise typer.Exit(code)


async def _run(request: str, plan: Any, settings: Any, config: Path | None, policy: Path | None,
               state_dir: Path | None, answers: list[str]) -> int:
    from tether.agent.executor import TaskRunner
    from tether.agent.llm import LLMClient
    from tether.agent.recovery import AskUser
    from tether.agent.task import Task, TaskEvent, TaskState
    from tether.agent.task_store import TaskStore
    from tether.device.local import open_device
    from tether.tools.context import default_state_dir

    out = console()
    llm = LLMClient(settings) if settings is not None else None
    store = TaskStore(Path(state_dir or default_state_dir()) / "tasks.db")
    task = Task(request=request, plan=plan)

    def show(event: TaskEvent) -> None:
        if event.kind in _SAVE_ON:  # the log survives a crash of this process, step by step
            store.save(task)
        d = event.data
        if event.kind == "plan":
            out.print(f"[bold]plan[/bold] ({d.get('source', 'llm')}):")
            for i, step in enumerate(d.get("steps", []), 1):
                out.print(f"  {i}. {step['skill']} {step.get('description') or step.get('args')}")
        elif event.kind == "step_started":
            again = f" (attempt {d['attempt']})" if d.get("attempt", 1) > 1 else ""
            out.print(f"[cyan]▶ step {d['step'] + 1}{again}:[/cyan] {d['skill']} {d.get('args')}")
        elif event.kind == "output":
            for line in str(d.get("data", "")).rstrip("\n").splitlines():
                out.print(f"    │ {line}", style="dim", markup=False, highlight=False)
        elif event.kind == "step_finished":
            style = "green" if d["status"] == "success" else "red"
            out.print(f"  [{style}]{d['status']}[/{style}]" + (f": {d['error']}" if d.get("error") else ""))
        elif event.kind == "decision":
            out.print(f"  [yellow]recovery:[/yellow] {d.get('decision')} "
                      f"{d.get('note') or d.get('suggestion') or d.get('question') or ''}")
        elif event.kind == "token":
            sys.stdout.write(str(d.get("text", "")))
            sys.stdout.flush()

    async def ask(question: AskUser) -> str:
        out.print(f"\n[bold yellow]?[/bold yellow] {question.question}")
        for i, option in enumerate(question.options, 1):
            out.print(f"  {i}. {option}")
        if answers:
            reply = answers.pop(0)
            out.print(f"  → {reply} (from --answer)")
            return reply
        if not sys.stdin.isatty():
            out.print("  → cancel (no terminal to ask; pass --answer to answer in advance)")
            return "cancel"
        return (await asyncio.to_thread(input, "answer (number or text): ")).strip()

    try:
        async with open_device(config, policy_path=policy, state_dir=state_dir) as device:
            computer = await device.computer_manager.get_or_create(None)
            dispatcher = device.dispatcher(session_id=task.id)
            runner = TaskRunner(lambda _device: dispatcher, llm, tools={None: computer.tool_infos()},
                                ask=ask, on_event=show)
            out.print(f"task {task.id}")
            await runner.run(task)
    finally:
        store.save(task)
        store.close()
        if llm is not None:
            await llm.close()
    streamed = any(e.kind == "token" for e in task.events)
    out.print()
    if task.answer and not streamed:
        out.print(f"[bold]answer:[/bold] {task.answer}")
    style = {TaskState.DONE: "green", TaskState.CANCELLED: "yellow"}.get(task.state, "red")
    out.print(f"[{style}]{task.state.value}[/{style}]" + (f": {task.error}" if task.error else ""))
    out.print(f"[dim]its file changes can be undone with: tether undo {task.id}"
              f"{' --state-dir ' + str(state_dir) if state_dir else ''}[/dim]")
    return 0 if task.state is TaskState.DONE else 1


@app.command()
def tasks(state_dir: StateOpt = None, as_json: JsonOpt = False,
          limit: Annotated[int, typer.Option(help="how many, newest first")] = 50) -> None:
    """List the tasks run on this machine, newest first, with their state."""
    import json

    from rich.table import Table

    from tether.agent.task_store import TaskStore
    from tether.tools.context import default_state_dir

    store = TaskStore(Path(state_dir or default_state_dir()) / "tasks.db")
    try:
        rows = store.list(limit)
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title=f"{len(rows)} tasks")
    for col in ("id", "state", "request", "updated"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["id"][:12], r["state"], r["request"][:60], r["updated_at"][:19].replace("T", " "))
    console().print(table)


@app.command()
def log(task_id: Annotated[str, typer.Argument(help="a task id (or a unique prefix of one)")],
        state_dir: StateOpt = None, as_json: JsonOpt = False) -> None:
    """Show a task's plan, every step with its command and result, decisions, questions and answer."""
    from tether.agent.task_store import TaskStore
    from tether.tools.context import default_state_dir

    store = TaskStore(Path(state_dir or default_state_dir()) / "tasks.db")
    try:
        task = store.get(task_id)
    finally:
        store.close()
    if task is None:
        fail(f"no task '{task_id}' (or the prefix matches several); 'tether tasks' lists them", code=1)
    if as_json:
        typer.echo(task.model_dump_json(indent=2))
        return
    out = console()
    out.print(f"[bold]task {task.id}[/bold] — {task.state.value}: {task.request}")
    if task.plan:
        out.print("[bold]plan[/bold]")
        for i, step in enumerate(task.plan.steps, 1):
            out.print(f"  {i}. {step.skill} {step.args}" + (f" — {step.description}" if step.description else ""))
    for record in task.steps:
        style = "green" if record.result.ok else "red"
        out.print(f"[cyan]step {record.index + 1} attempt {record.attempt}[/cyan] {record.command.tool_name} "
                  f"{record.command.parameters} → [{style}]{record.result.status.value}[/{style}]"
                  + (f": {record.result.error}" if record.result.error else ""))
        if record.decision:
            out.print(f"    decision: {record.decision.get('decision')} "
                      f"{record.decision.get('note') or record.decision.get('suggestion') or ''}")
    for q in task.questions:
        out.print(f"[yellow]question:[/yellow] {q.question} {q.options} → {q.answer}")
    if task.answer:
        out.print(f"[bold]answer:[/bold] {task.answer}")
    if task.error:
        out.print(f"[red]error:[/red] {task.error}")
