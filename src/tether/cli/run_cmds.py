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

from tether.cli.common import ConfigOpt, PolicyOpt, StateOpt, app, console, fail


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
    from tether.device.local import open_device

    out = console()
    llm = LLMClient(settings) if settings is not None else None

    def show(event: TaskEvent) -> None:
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
            task = Task(request=request, plan=plan)
            dispatcher = device.dispatcher(session_id=task.id)
            runner = TaskRunner(lambda _device: dispatcher, llm, tools={None: computer.tool_infos()},
                                ask=ask, on_event=show)
            out.print(f"task {task.id}")
            await runner.run(task)
    finally:
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
