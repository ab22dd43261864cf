"""Tasks on a server: `tether run` against one, following a task live, and `tether answer`, `approve`,
`deny`, `edit`, `cancel`. `tether tasks`, `log` and `undo` use the helpers here when given a server.

A task on a server lives there, not in this terminal: Ctrl-C detaches (the task goes on), and a
question nobody here can answer leaves the task waiting for `tether answer` (exit code 3).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tether.agent.run.replies import AnswerError, parse_answer
from tether.cli import completion as complete
from tether.cli.common import (
    INTERRUPTED,
    CaOpt,
    ExitCode,
    JsonOpt,
    ServerOpt,
    StateOpt,
    TokenOpt,
    app,
    console,
    fail,
    fail_remote,
    remote_message,
)
from tether.cli.views.task import EventView, print_log, print_outcome
from tether.client.rest import RemoteError, RemoteServer

TaskArg = Annotated[str, typer.Argument(help="a task id (or a unique prefix of one)", autocompletion=complete.tasks)]
EXIT_WAITING = ExitCode.WAITING  # the task waits on the server for an answer nobody here could give
EXIT_DETACHED = INTERRUPTED  # Ctrl-C while following: the task goes on on the server

_APPROVE = {"approve", "approved", "yes", "y"}
_DENY = {"deny", "denied", "no", "n"}


def connect(server: str | None, token: str | None, ca_file: str | None) -> RemoteServer:
    return RemoteServer(server, token, ca_file=ca_file)


def run_remote(remote: RemoteServer, request: str, plan: list[dict[str, Any]] | None, device: str | None,
               requires: dict[str, Any] | None, answers: list[str], devices: list[str] | None = None,
               confirm: str | None = None) -> int:
    """Create the task on the server and follow it here, answering its questions; the exit code."""
    out = console()
    try:
        summary = remote.create_task(request, plan=plan, device=device, requires=requires, devices=devices,
                                     confirm=confirm)
    except RemoteError as exc:
        fail_remote(exc, ExitCode.USAGE)
    out.print(f"task {summary['id']} on {summary['device']} ({remote.base_url})", markup=False)
    code = follow(remote, summary["id"], out, answers=answers)
    if code in (0, 1) and may_have_changed_files(remote, summary["id"]):
        out.print(f"[dim]its file changes can be undone with: tether undo {summary['id']} --server "
                  f"{remote.base_url}[/dim]")
    return code


def may_have_changed_files(remote: RemoteServer, task_id: str) -> bool:
    """Whether a server's task ran a command that may have changed files: a step that succeeded with a tool
    its device does not list as data_collection (read-only). True when that cannot be told (the server or
    the device does not answer): the undo hint is then shown, as before."""
    try:
        data = remote.task(task_id, events=False)
        ran = {s["command"]["tool_name"] for s in data.get("steps", [])
               if (s.get("result") or {}).get("status") == "success"}
        if not ran:
            return False
        device = data.get("device")
        read_only = {i.name for i in remote.tools(device, timeout=5) if i.tool_type == "data_collection"} if device \
            else set()
    except (RemoteError, KeyError, TypeError):
        return True
    return bool(ran - read_only)


def follow(remote: RemoteServer, task_id: str, out: Console, *, answers: list[str] | None) -> int:
    """Print a task's events until it ends; with `answers` (a list, maybe empty) also answer its questions,
    from the list first, then in the terminal. 0 done, 1 failed or cancelled, 3 left waiting, 130 detached."""
    from tether.cli.views.spinner import Spinner

    spinner = Spinner()  # the status line, redrawn at each event here (a terminal only)
    view = EventView(out, echo_answers=answers is None, spinner=spinner)
    waiting_on: dict[str, Any] | None = None
    try:
        for name, data in remote.task_events(task_id, patience=follow_patience(), on_gone=_say_gone):
            if name == "end":
                spinner.stop()
                print_outcome(out, data["state"], data.get("answer"), data.get("error"), streamed=view.streamed)
                return 0 if data["state"] == "done" else 1
            kind, body = data["kind"], data.get("data", {})
            if kind == "question" and body.get("id") in view.questions:
                continue  # the same open question, asked again by a task resumed with its answer
            view(kind, body)
            if kind == "question":
                waiting_on = body
                if answers is not None and not _answer(remote, task_id, body, answers, out):
                    return EXIT_WAITING
            elif kind == "user_answer":
                waiting_on = None
    except KeyboardInterrupt:
        spinner.stop()
        out.print(f"\n[yellow]detached: task {task_id} goes on on the server.[/yellow]")
        if waiting_on is not None:
            _how_to_answer(out, task_id, waiting_on)
        out.print(f"  follow it: tether log {task_id} --follow\n  cancel it: tether cancel {task_id}")
        return EXIT_DETACHED
    except RemoteError as exc:
        spinner.stop()
        fail_remote(exc, ExitCode.FAILED, f"; follow it again: tether log {task_id} --follow")
    fail(f"the event stream of task {task_id} ended without saying how the task ended", code=1)


def follow_patience() -> float:
    """How long a follower waits for a server that went away before giving up, in seconds:
    TETHER_FOLLOW_PATIENCE, else 60 (a restart's time); a value that is not a positive number is a usage error."""
    raw = os.environ.get("TETHER_FOLLOW_PATIENCE", "60")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        fail(f"TETHER_FOLLOW_PATIENCE must be a positive number of seconds, not {raw!r}", code=ExitCode.USAGE)
    return value


def _say_gone(problem: str) -> None:
    typer.echo(f"the server went away; following again when it is back ({problem})", err=True)


def _answer(remote: RemoteServer, task_id: str, question: dict[str, Any], answers: list[str], out: Console) -> bool:
    """Answer `question` from `answers`, else in the terminal, until the server takes an answer;
    False when nobody here can give one (the task keeps waiting on the server)."""
    options = list(question.get("options", []))
    while True:
        reply = _reply(task_id, question, answers, out)
        if reply is None:
            return False
        try:  # the parser a local task uses: empty or out-of-range answers are asked again
            reply = parse_answer(reply, options, str(question.get("kind") or "question"))
        except AnswerError as exc:
            out.print(str(exc), style="yellow", markup=False)
            continue
        chosen = options[int(reply) - 1] if reply.isdigit() and 1 <= int(reply) <= len(options) else reply
        try:
            digest = question.get("digest")  # the approval is bound to what was printed above
            if question.get("kind") == "approval" and chosen.lower() in _APPROVE | _DENY:
                remote.approve(task_id, chosen.lower() in _APPROVE, digest=digest)
            else:
                remote.answer(task_id, reply, question.get("id"), digest=digest)
            return True
        except RemoteError as exc:
            out.print(f"the answer was not taken: {remote_message(exc)}", style="red", markup=False)
            if exc.status == 409:  # answered meanwhile from elsewhere, or the task moved on: follow it
                return True


def _reply(task_id: str, question: dict[str, Any], answers: list[str], out: Console) -> str | None:
    if answers:
        reply = answers.pop(0)
        out.print(f"  → {reply} (from --answer)", markup=False)
        return reply
    if sys.stdin.isatty():
        try:
            reply = ""
            while not reply:
                reply = input("answer (number or text): ").strip()
            return reply
        except EOFError:
            pass
    else:
        out.print(f"[yellow]no terminal to ask and no --answer left: task {task_id} waits on the server.[/yellow]")
    _how_to_answer(out, task_id, question)
    return None


def _how_to_answer(out: Console, task_id: str, question: dict[str, Any]) -> None:
    if question.get("kind") == "approval":
        out.print(f"  approve it: tether approve {task_id}\n  deny it:    tether deny {task_id}")
    else:
        out.print(f"  answer it:  tether answer {task_id} ANSWER   (an option's number or words)")


def print_tasks(rows: list[dict[str, Any]], as_json: bool, where: str, wide: bool = False) -> None:
    """The tasks as JSON or as a table that fits the terminal: id and state whole (an id is copied), then
    device, request, who asked (`by`: what a person approving must see) and when, dropped in that order
    from the last; `wide`: every column."""
    from tether.cli.views.table import Column, print_table

    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    columns = [Column("id"), Column("state"), Column("device", 1), Column("by", 3),
               Column("request", 2, flex=True, min_width=20), Column("updated", 4)]
    cells = [[r["id"][:12], r["state"], escape(r.get("device") or "-"), escape(r.get("requested_by") or "-"),
              escape(r["request"][:60]), r["updated_at"][:19].replace("T", " ")] for r in rows]
    print_table(f"{len(rows)} tasks{where}", columns, cells, wide)


def remote_log(remote: RemoteServer, task_id: str, as_json: bool, follow_it: bool) -> int:
    from tether.agent.run.task import Task

    out = console()
    try:
        if follow_it:
            return follow(remote, remote.task(task_id, events=False)["id"], out, answers=None)
        data = remote.task(task_id)
    except RemoteError as exc:
        fail_remote(exc, ExitCode.FAILED)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        print_log(out, Task.model_validate({k: v for k, v in data.items() if k != "graph"}))  # graph: derived
    return 0


def remote_undo(remote: RemoteServer, task_id: str, as_json: bool, not_found_hint: str = "") -> int:
    """Undo a server's task; `not_found_hint` is added to the server's 404 (e.g. "it is a local session")."""
    try:
        report = remote.undo_task(task_id)
    except RemoteError as exc:
        fail_remote(exc, ExitCode.FAILED, not_found_hint if exc.status == 404 else "")
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
    devices: dict[str, dict[str, Any]] = report.get("devices", {})
    failed = [name for name, r in devices.items() if "error" in r]
    if as_json:
        return 1 if failed else 0
    out = console()
    if not devices:
        out.print(f"task {task_id} ran no command on any device: nothing to undo")
        return 0
    table = Table(title=f"undo task {task_id}")
    for col in ("device", "action", "path", "outcome"):
        table.add_column(col)
    for name, r in devices.items():
        if "error" in r:
            table.add_row(escape(name), "-", "-", f"[red]error: {escape(str(r['error']))}[/red]")
            continue
        restored = r.get("restored") or []
        if not restored:
            table.add_row(name, "-", "-", "nothing to undo")
        for entry in restored if isinstance(restored, list) else [restored]:
            entry = entry if isinstance(entry, dict) else {"outcome": entry}
            table.add_row(escape(name), escape(str(entry.get("action", "-"))), escape(str(entry.get("path", "-"))),
                          escape(str(entry.get("outcome", "-"))))
    out.print(table)
    return 1 if failed else 0


def _steer(server: str | None, token: str | None, ca_file: str | None, act: Any, done: str, as_json: bool) -> None:
    try:
        with connect(server, token, ca_file) as remote:
            summary = act(remote)
    except RemoteError as exc:
        fail_remote(exc, ExitCode.FAILED)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    out = console()
    if summary["state"] in ("done", "failed", "cancelled"):
        out.print(f"{done}; task {summary['id']} is {summary['state']}")
    else:  # the task resumes on the server right after this answer
        out.print(f"{done}; task {summary['id']} goes on\n[dim]follow it: tether log {summary['id'][:12]} "
                  "--follow[/dim]")


@app.command()
def answer(task_id: TaskArg, text: Annotated[str, typer.Argument(metavar="ANSWER",
                                                                 help="an option's number or words, or free text")],
           question: Annotated[str | None, typer.Option("--question", help="the question's id (refused if it is "
                                                                           "no longer the open one)")] = None,
           server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None, as_json: JsonOpt = False) -> None:
    """Answer the open question of a task on the server; the task resumes where it stopped."""
    _steer(server, token, ca_file, lambda r: r.answer(task_id, text, question), f"answered: {text}", as_json)


@app.command()
def approve(task_id: TaskArg, deny: Annotated[bool, typer.Option("--deny", help="deny instead")] = False,
            always: Annotated[str | None, typer.Option(
                "--always", help="for a shell command the device's policy asks about: 'program' allows the program "
                                 "on that device for good, 'subcommand' only the program with this first argument "
                                 "(an audited policy change; admin scope)")] = None,
            server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None, as_json: JsonOpt = False) -> None:
    """Approve the action a task on the server waits on (with --deny: deny it, which cancels the task)."""
    if always is not None and (deny or always not in ("program", "subcommand")):
        fail("--always takes program or subcommand, and goes with an approval")
    _steer(server, token, ca_file, lambda r: r.approve(task_id, not deny, always, digest=_shown(r, task_id)),
           "denied" if deny else "approved", as_json)


def _shown(remote: RemoteServer, task_id: str) -> str | None:
    """Print what the task waits on and who asked for it (on stderr), and return its digest: the approval
    sent next is bound to exactly this, and refused if the task waits on anything else by then."""
    task = remote.task(task_id, events=False)
    pending = next((q for q in reversed(task.get("questions") or []) if q.get("answer") is None), None)
    if pending is None:
        return None
    err = console(err=True)
    err.print(f"task {escape(task['id'][:12])}, asked by {escape(task.get('requested_by') or 'unknown')}:",
              highlight=False)
    err.print(escape(str(pending.get("question") or "")), highlight=False)
    digest = pending.get("digest")
    if digest:
        err.print(f"[dim]digest {escape(str(digest))}[/dim]", highlight=False)
    return digest if isinstance(digest, str) else None


@app.command()
def deny(task_id: TaskArg, server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
         as_json: JsonOpt = False) -> None:
    """Deny the action a task on the server waits on; the task is cancelled."""
    _steer(server, token, ca_file, lambda r: r.approve(task_id, False), "denied", as_json)


@app.command()
def edit(task_id: TaskArg,
         file: Annotated[Path, typer.Option("--file", "-f", help="the edit, YAML or JSON: {add: [steps], remove: "
                                                                  "[ids], add_needs: {id: [ids]}}")],
         server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None, as_json: JsonOpt = False) -> None:
    """Edit a running graph task on the server from a YAML or JSON file: add steps, remove steps not
    started, add needs. The server checks the edit against the whole graph and applies it at once or
    refuses it with every reason (docs/graphs.md)."""
    import yaml

    from tether import yaml12

    try:
        body = yaml12.safe_load(file.read_text(encoding="utf-8"))
    except OSError as exc:
        fail(f"cannot read the edit {file}: {exc.strerror or exc}")
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        fail(f"the edit {file} is not valid YAML or JSON: {yaml12.where_and_why(exc)}")
    if not isinstance(body, dict):
        fail(f"{file}: the edit must be a mapping with add, remove and/or add_needs")
    try:
        with connect(server, token, ca_file) as remote:
            result = remote.edit_task(task_id, body)
    except RemoteError as exc:
        fail_remote(exc, ExitCode.FAILED)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    states = ", ".join(f"{i + 1} {s}" for i, s in enumerate(result.get("step_states", [])))
    if result.get("status") == "applied":
        console().print(f"edit applied; task {result['task']} steps: {states}")
    else:
        console().print(f"the new steps wait for a person's confirmation; task {result['task']}\n[dim]tether "
                        f"approvals, or tether answer {result['task'][:12]} run[/dim]")


@app.command()
def cancel(task_id: TaskArg, server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
           as_json: JsonOpt = False, state_dir: StateOpt = None,
           local: Annotated[bool, typer.Option("--local", help="this machine's task, even when TETHER_SERVER "
                                                               "is set")] = False) -> None:
    """Cancel a task: on the server with --server (or TETHER_SERVER; the command it is running is stopped
    on its device), else this machine's (an interrupted one, or one no tether process runs any more)."""
    if server and not local:
        _steer(server, token, ca_file, lambda r: r.cancel(task_id), "cancelled", as_json)
        return
    from tether.cli.local.tasks import cancel_local

    try:
        found, state = cancel_local(task_id, state_dir)
    except (LookupError, ValueError) as exc:
        fail(str(exc).strip("'\""), code=1)
    if as_json:
        typer.echo(json.dumps({"id": found, "state": state}, indent=2))
        return
    console().print(f"cancelled; task {found} is {state}")
