"""How a task looks in the terminal, the same whether it runs here or on a server's device.

`EventView` prints a task's events as they come (`tether run`, `tether log --follow`), `print_log`
prints a whole task afterwards (`tether log`), `print_outcome` prints how it ended.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape

from tether.agent.run.task import Task
from tether.cli.common import progress_line
from tether.cli.views.safe_text import visible
from tether.cli.views.spinner import Spinner
from tether.cli.views.terminal_output import TerminalLines


def print_question(out: Console, question: str, options: list[str]) -> None:
    out.print(f"\n[bold yellow]?[/bold yellow] {_e(question)}")
    for i, option in enumerate(options, 1):
        out.print(f"  {i}. {option}", markup=False, highlight=False)


def _e(value: Any) -> str:
    """A task's, a tool's or a person's words inside our markup: their `[...]` stays text."""
    return escape(str(value))


class EventView:
    """Prints task events live. `echo_answers`: also print answers given elsewhere (a passive follower);
    whoever answers in this terminal prints its own. `streamed` tells whether the answer came as tokens."""

    def __init__(self, out: Console, *, echo_answers: bool = False, spinner: Spinner | None = None,
                 mcp_questions_asked_here: bool = False) -> None:
        self.out = out
        # a local run whose MCP servers' questions are prompted in this terminal (cli_hooks) prints them there
        self.mcp_questions_asked_here = mcp_questions_asked_here
        self.echo_answers = echo_answers
        self.streamed = False
        self.questions: set[str] = set()
        self.spinner = spinner  # the status line while the LLM plans or a step runs (a terminal only)
        self.lines = TerminalLines(self._output_line)  # chunks joined into lines, \r rewriting, per stream

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if self.spinner is not None:
            if kind == "planning_progress":
                self.spinner.count(int(data.get("tokens") or 0))
                return
            self.spinner.erase()
        self._print(kind, data)
        if self.spinner is not None:
            status_after(self.spinner, kind, data)

    def _output_line(self, stream: str, line: str) -> None:
        self.out.print(f"    │ {line}", style="dim", markup=False, highlight=False, soft_wrap=True)

    def _print(self, kind: str, data: dict[str, Any]) -> None:
        out, d = self.out, data
        if kind == "output":
            self.lines.feed(str(d.get("call_id") or d.get("step") or ""), str(d.get("stream") or "stdout"),
                            str(d.get("data", "")))
            return
        self.lines.flush()  # anything else (a step's end first) shows a command's unended last line
        if kind == "question":  # a resumed task asks its open question again: show it once
            if d.get("id") in self.questions:
                return
            self.questions.add(str(d.get("id")))
        if kind == "plan":
            start = int(d.get("from_step") or 0)
            out.print(f"[bold]plan[/bold] ({d.get('source', 'llm')}):")
            for i, step in enumerate(d.get("steps", []), start + 1):
                where = f" [dim]on {_e(step['device'])}[/dim]" if step.get("device") else ""
                out.print(f"  {i}. {_e(step['skill'])} {_e(step.get('description') or step.get('args'))}{where}")
        elif kind == "planning" and d.get("recovery_context"):
            out.print("  [yellow]re-planning the rest of the task[/yellow]")
        elif kind == "step_started":
            again = f" (attempt {d['attempt']})" if d.get("attempt", 1) > 1 else ""
            where = f" on {_e(d['device'])}" if d.get("device") else ""
            out.print(f"[cyan]▶ step {d['step'] + 1}{again}{where}:[/cyan] {_e(d['skill'])} {_e(d.get('args'))}")
        elif kind == "progress":
            out.print(f"    │ {progress_line(d)}", style="dim", markup=False, highlight=False)
        elif kind == "elicitation" and d.get("message") and not self.mcp_questions_asked_here:
            out.print(f"    ? MCP server {d.get('server')} asks: {d.get('message')}", markup=False, highlight=False)
        elif kind == "step_finished":
            style = "green" if d["status"] == "success" else "red"
            out.print(f"  [{style}]{d['status']}[/{style}]" + (f": {_e(d['error'])}" if d.get("error") else ""))
        elif kind == "decision":  # an ASK_USER's question is printed by its own event, right after
            detail = d.get("note") or d.get("suggestion") or (d.get("reason") if d.get("question") else "") or ""
            out.print(f"  [yellow]recovery:[/yellow] {_e(d.get('decision'))} {_e(detail)}".rstrip())
        elif kind == "skipped":
            out.print(f"  [yellow]step {d.get('step', 0) + 1} skipped[/yellow]")
        elif kind == "question":
            print_question(out, str(d.get("question", "")), list(d.get("options", [])))
        elif kind == "user_answer" and self.echo_answers:
            out.print(f"  → {d.get('answer')}", markup=False, highlight=False)
        elif kind == "token":
            self.streamed = True
            sys.stdout.write(visible(d.get("text", "")))  # a model's words: shown, not obeyed
            sys.stdout.flush()
        elif kind == "interrupted":
            out.print("[yellow]the server stopped while the task was going; it is settled when the server "
                      "starts again[/yellow]")
        elif kind == "server_restarted":
            out.print(f"[yellow]the server restarted (the task was {_e(d.get('state'))})[/yellow]")


_STATUS_ENDS = {"plan", "step_finished", "question", "token", "answer", "interrupted", "decision"}


def status_after(spinner: Spinner, kind: str, d: dict[str, Any]) -> None:
    """What the status line says after an event: planning, a step running, or nothing."""
    if kind == "planning":
        spinner.set("planning the next part from what was seen" if d.get("observing") else
                    "re-planning" if d.get("recovery_context") else "planning")
    elif kind == "step_started":
        spinner.set(f"step {int(d.get('step', 0)) + 1}: {d.get('skill')}")
    elif kind in _STATUS_ENDS or (kind == "state" and d.get("to") not in ("planning", "running")):
        spinner.stop()


def print_outcome(out: Console, state: str, answer: str | None, error: str | None, *, streamed: bool) -> None:
    out.print()
    if answer and not streamed:
        out.print(f"[bold]answer:[/bold] {_e(answer)}")
    style = {"done": "green", "cancelled": "yellow"}.get(state, "red")
    out.print(f"[{style}]{state}[/{style}]" + (f": {_e(error)}" if error else ""), soft_wrap=True)


def print_log(out: Console, task: Task) -> None:
    """A task's plan, every step with its command and result, decisions, questions and answer."""
    where = f" on {_e(task.device)}" if task.device else ""
    out.print(f"[bold]task {task.id}[/bold]{where} — {task.state.value}: {_e(task.request)}")
    if task.plan:
        out.print("[bold]plan[/bold]")
        for i, step in enumerate(task.plan.steps, 1):
            out.print(f"  {i}. {_e(step.skill)} {_e(step.args)}" + (f" — {_e(step.description)}" if step.description
                                                                     else "")
                      + (f" [dim](on {_e(step.device)})[/dim]" if step.device else ""))
    from tether.agent.run.graph.view import draw

    for line in draw(task):
        out.print(line, markup=False, highlight=False)
    for record in task.steps:
        style = "green" if record.result.ok else "red"
        out.print(f"[cyan]step {record.index + 1} attempt {record.attempt}[/cyan] {_e(record.command.tool_name)} "
                  f"{_e(record.command.parameters)} → [{style}]{record.result.status.value}[/{style}]"
                  + (f": {_e(record.result.error)}" if record.result.error else ""))
        head = result_head(record.result.result)
        if head:
            out.print(f"    result: {head}", markup=False, highlight=False, soft_wrap=True)
        if record.decision:
            out.print(f"    decision: {decision_line(task, record.index, record.decision)}", markup=False,
                      highlight=False, soft_wrap=True)
    for event in task.events:
        if event.kind == "step_started" and not any(r.command.call_id == event.data.get("call_id")
                                                    for r in task.steps):
            out.print(f"[cyan]step {event.data.get('step', 0) + 1} attempt {event.data.get('attempt', 1)}[/cyan] "
                      f"{_e(event.data.get('skill'))} {_e(event.data.get('args'))} → "
                      "[yellow]no result recorded[/yellow]")
        elif event.kind == "skipped":
            out.print(f"[yellow]step {event.data.get('step', 0) + 1} skipped[/yellow]")
    for q in task.questions:
        kind = "" if q.kind == "question" else f" ({q.kind})"
        out.print(f"[yellow]question{kind}:[/yellow] {_e(q.question)} {_e(q.options)} → "
                  + (_e(q.answer) if q.answer is not None else "[bold]waiting for an answer[/bold]"))
    if task.answer:
        out.print(f"[bold]answer:[/bold] {_e(task.answer)}")
    if task.error:
        out.print(f"[red]error:[/red] {_e(task.error)}", soft_wrap=True)


def result_head(value: Any, limit: int = 160) -> str:
    """A step's result in one line: a command's exit code and first output line, a tool's value cut
    short. The whole result stays in `tether log --json`."""
    if value is None or value == "" or value == {}:
        return ""
    if isinstance(value, dict) and "stdout" in value:
        code = value.get("exitCode", value.get("exit_code"))
        parts = [f"exit {code}"] if code is not None else []
        for stream in ("stdout", "stderr"):
            lines = [ln for ln in str(value.get(stream) or "").splitlines() if ln.strip()]
            if lines:
                more = f" (+{len(lines) - 1} lines)" if len(lines) > 1 else ""
                parts.append(f"{stream}: {_cut(lines[0], limit)}{more}")
        return ", ".join(parts)
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return _cut(" ".join(text.split()), limit)


def decision_line(task: Task, index: int, decision: dict[str, Any]) -> str:
    """A recovery decision, and for ASK_USER the question it asked and the answer it got."""
    kind = str(decision.get("decision"))
    detail = str(decision.get("note") or decision.get("suggestion") or "")
    if kind != "ASK_USER":
        return f"{kind} {detail}".rstrip()
    asked = next((q for q in task.questions if q.step == index and q.question == decision.get("question")),
                 None) or next((q for q in task.questions if q.step == index), None)
    question = asked.question if asked is not None else str(decision.get("question") or "")
    answer = "no answer yet" if asked is None or asked.answer is None else f"answered: {asked.answer}"
    if asked is not None and asked.answer and asked.answer.isdigit() and 1 <= int(asked.answer) <= len(asked.options):
        answer += f" ({asked.options[int(asked.answer) - 1]})"
    return f"{kind}: asked \"{question}\" → {answer}"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"
