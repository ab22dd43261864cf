"""`tether undo` and `tether sessions`: the undo journal of this machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from tether.cli import completion as complete
from tether.cli.common import (
    CaOpt,
    JsonOpt,
    OutputOpt,
    PolicyOpt,
    ServerOpt,
    StateOpt,
    TokenOpt,
    app,
    console,
    fail,
    output_mode,
)

if TYPE_CHECKING:
    from tether.device.local import StateDirBusy
    from tether.tools.journal import UndoJournal


@app.command()
def undo(session: Annotated[str, typer.Argument(help="the session (or task) whose file changes to put back",
                                               autocompletion=complete.tasks)],
         state_dir: StateOpt = None, as_json: JsonOpt = False, policy: PolicyOpt = None,
         server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
         local: Annotated[bool, typer.Option("--local", help="this machine's journal, even when TETHER_SERVER "
                                                             "is set")] = False) -> None:
    """Put back the files that a session's commands changed (a local task's id is its session).

    With --server (or TETHER_SERVER): SESSION is a task on that server, undone on every device it ran on.
    Locally, files are put back only inside the write roots of --policy (or the default policy), and
    never through a symlink planted since the change.
    """
    if server and not local:
        from tether.cli.commands.tasks.task import connect, remote_undo

        with connect(server, token, ca_file) as remote:
            raise typer.Exit(remote_undo(remote, session, as_json, _local_hint(session, state_dir, server)))
    from tether.cli.guards.state_lock import holding_state_dir
    from tether.tools.context import default_state_dir
    from tether.tools.journal import UndoJournal
    from tether.tools.policy.model import load_policy

    state = Path(state_dir or default_state_dir())
    # the journal is written by whatever runs commands on this state directory: a restore beside a running
    # device could put a file back under a command that is changing it. Another local one-off call is waited for.
    with holding_state_dir(state, "tether undo", wait_s=60, refusal=_busy):
        journal = UndoJournal(state)
        session = _session_named(journal, session, state_dir)
        try:
            report = journal.restore(session, load_policy(policy).write_roots)
        except ValueError as exc:
            fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
        return
    if not report:
        console().print(f"nothing to undo for session {session}")
        return
    table = Table(title=f"undo {session}")
    for col in ("action", "path", "outcome"):
        table.add_column(col)
    for entry in report:
        table.add_row(*(escape(str(entry.get(k))) for k in ("action", "path", "outcome")))
    console().print(table)


def _busy(busy: StateDirBusy) -> str:
    """The one line `tether undo --local` says when another process uses the journal's state directory."""
    who = f"another {busy.holder} (pid {busy.pid})" if busy.pid else f"another {busy.holder}"
    through = (" (what it ran for a server is undone through the server: tether undo TASK --server URL)"
               if busy.holder == "tether device" else "")
    return (f"{who} uses the state directory {busy.directory} and writes its undo journal: stop it before "
            f"undoing here{through}")


def _local_hint(session: str, state_dir: Path | None, server: str) -> str:
    """When a server does not know `session`: whether this machine's journal does (a local `tether exec
    --session`, a local task), and how to undo it here."""
    from tether.tools.context import default_state_dir
    from tether.tools.journal import UndoJournal

    try:
        known = [row["session_id"] for row in UndoJournal(Path(state_dir or default_state_dir())).sessions()]
    except Exception:  # no journal here, or one this user cannot read: no hint
        return ""
    if any(name == session or name.startswith(session) for name in known):
        return (f"\nhint: '{session}' is a session of this machine's journal (a local `tether exec --session` or "
                f"`tether run`), not a task of {server} (TETHER_SERVER or --server): undo it here with "
                f"`tether undo {session} --local`")
    return "\nhint: the server's task ids are listed by `tether tasks`; this machine's sessions by `tether sessions`"


def _session_named(journal: UndoJournal, given: str, state_dir: Path | None) -> str:
    """The journaled session `given` names, whole or by a unique prefix (as `tether tasks` ids are
    copied); an error exit when it names none or several, so a typo never reads as 'nothing to undo'."""
    known = [row["session_id"] for row in journal.sessions()]
    if given in known:
        return given
    matching = [name for name in known if name.startswith(given)]
    if len(matching) == 1:
        return matching[0]
    if matching:
        fail(f"'{given}' is the start of several sessions ({', '.join(matching[:5])}); give more of it", code=1)
    from tether.cli.local.tasks import open_local_store

    store = open_local_store(state_dir)
    try:
        task = store.get(given)
    finally:
        store.close()
    if task is not None:  # a task that changed no files: there is truly nothing to put back
        console().print(f"nothing to undo: task {task.id} changed no files")
        raise typer.Exit(0)
    fail(f"nothing to undo: no session or task '{given}' on this machine ('tether sessions' lists what can "
         "be undone, 'tether tasks' the tasks)", code=1)


@app.command()
def sessions(state_dir: StateOpt = None, as_json: JsonOpt = False, output: OutputOpt = None) -> None:
    """List the sessions that have journaled file changes (what `undo` can put back)."""
    # No state-directory lock, like the other local readers (`tether tasks`, `tether log`): it reads each
    # session's index, which is only ever appended to in whole lines (`UndoJournal._append`; a torn line is
    # skipped) and never rewritten, and changes nothing; the lock would only refuse a look beside a running device.
    from tether.cli.views.table import KEY, Column, print_table
    from tether.tools.context import default_state_dir
    from tether.tools.journal import UndoJournal

    as_json, wide = output_mode(output, as_json)
    rows = UndoJournal(Path(state_dir or default_state_dir())).sessions()
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    keys = list(rows[0]) if rows else ["session_id"]
    # the id is what `tether undo` takes: whole, never cut; the other columns dropped from the last
    columns = [Column(key, KEY if key == "session_id" else n + 1) for n, key in enumerate(keys)]
    print_table("journaled sessions", columns, [[escape(str(row.get(k))) for k in keys] for row in rows], wide)
