"""`tether approvals`: the inbox of what waits for a person (GET /api/v1/approvals), and answering it
(`approve ID`, `deny ID`, `answer ID TEXT`); `tether webhooks`: where notifications go. docs/approvals.md."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.markup import escape

from tether.cli import completion as complete
from tether.cli.common import CaOpt, ExitCode, JsonOpt, OutputOpt, ServerOpt, TokenOpt, app, console, fail, fail_remote

approvals_app = typer.Typer(invoke_without_command=True, no_args_is_help=False,
                            help="List what waits for your answer (approvals, plans to confirm, questions), "
                                 "and answer it.")
webhooks_app = typer.Typer(invoke_without_command=True, no_args_is_help=False,
                           help="Webhooks told of approvals needed, tasks finished or failed, devices offline.")
app.add_typer(approvals_app, name="approvals")
app.add_typer(webhooks_app, name="webhooks")

WebhookArg = Annotated[str, typer.Argument(metavar="ID", help="the webhook's id (`tether webhooks` lists them)")]
ItemArg = Annotated[str, typer.Argument(metavar="ID", help="an inbox item: a task id (or prefix) or DEVICE/QUESTION",
                                        autocompletion=complete.inbox)]


def _ago(seconds: float) -> str:
    age = max(0, int(time.time() - seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if age >= size:
            return f"{age // size}{unit} ago"
    return f"{age}s ago"


def _remote(server: str | None, token: str | None, ca_file: str | None) -> Any:
    from tether.client.rest import RemoteServer

    return RemoteServer(server, token, ca_file=ca_file)


def _output(output: str | None, as_json: bool) -> tuple[bool, bool]:
    if output not in (None, "wide", "json"):
        fail(f"-o {output}: give wide or json")
    return as_json or output == "json", output == "wide"


@approvals_app.callback()
def approvals(ctx: typer.Context, server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
              as_json: JsonOpt = False, output: OutputOpt = None) -> None:
    """List what waits for your answer (approvals, plans to confirm, questions), and answer it."""
    if ctx.invoked_subcommand:
        return
    from tether.client.rest import RemoteError

    as_json, wide = _output(output, as_json)
    try:
        with _remote(server, token, ca_file) as remote:
            items = remote.approvals()
    except RemoteError as exc:
        fail_remote(exc)
    if as_json:
        typer.echo(json.dumps(items, indent=2))
    else:
        from tether.cli.views.table import Column, print_table

        columns = [Column("id"), Column("kind"), Column("device", 2), Column("asked", 3),
                   Column("question", 1, flex=True, min_width=24), Column("by", 4)]
        cells = [[escape(i["id"] if i["source"] == "device" else i["id"][:12]), i["kind"],
                  escape(i.get("device") or "-"),
                  _ago(i["asked_at"]), escape(str(i.get("question") or "")[:200]),
                  escape(i.get("requested_by") or "-")] for i in items]
        if items:
            print_table(f"{len(items)} waiting for you", columns, cells, wide)
            console().print("[dim]answer: tether approvals approve ID | deny ID | answer ID TEXT[/dim]")
        else:
            console().print("nothing waits for you")
    raise typer.Exit(ExitCode.WAITING if items else ExitCode.OK)


def _item(remote: Any, item_id: str) -> dict[str, Any]:
    items = remote.approvals()
    found = [i for i in items if i["id"] == item_id] or [i for i in items if i["source"] == "task"
                                                          and i["id"].startswith(item_id)]
    if len(found) != 1:
        fail(f"{'no' if not found else 'more than one'} item {item_id!r} in your inbox"
             + (" (`tether approvals` lists it)" if not found else ": give more of the id"), ExitCode.FAILED)
    return found[0]


_YES = ("yes", "approve", "approved", "allow", "accept", "confirm", "confirmed", "ok", "proceed", "y")


def _consent(item_id: str, schema: Any) -> dict[str, Any] | None:
    """The content that says yes to a consent question's form: every boolean true, a yes among the choices.
    A form that asks for anything else (a choice with no yes among it, a text, a number) is not approved: a yes is
    never turned into a choice the person did not make (the MCP server orders its choices). Usage error then,
    nothing sent; `tether approvals answer` gives the value."""
    fields = (schema or {}).get("properties") or {} if isinstance(schema, dict) else {}
    content: dict[str, Any] = {}
    for name, field in fields.items():
        if not isinstance(field, dict):
            continue
        if field.get("type") == "boolean":
            content[name] = True
            continue
        options = [o for o in field.get("enum") or [] if isinstance(o, str)]
        yes = next((o for o in options if o.strip().lower() in _YES), None)
        if yes is None:
            asked = f"one of: {', '.join(options)}" if options else f"a {field.get('type') or 'value'}"
            fail(f"{item_id} asks for {name} ({asked}), not a yes; nothing was sent: answer it with "
                 f"`tether approvals answer {item_id} VALUE`")
        content[name] = yes
    return content or None


def _act(item_id: str, verb: str, text: str | None, server: str | None, token: str | None, ca_file: str | None,
         as_json: bool) -> None:
    from tether.client.rest import RemoteError

    try:
        with _remote(server, token, ca_file) as remote:
            item = _item(remote, item_id)
            if item["source"] == "device":
                if verb == "answer":
                    field = next(iter((item.get("schema") or {}).get("properties") or {"answer": {}}), "answer")
                    result = remote.answer_question(item["device"], item["question_id"], "accept", {field: text})
                elif verb == "approve":
                    result = remote.answer_question(item["device"], item["question_id"], "accept",
                                                    _consent(item_id, item.get("schema")))
                else:
                    result = remote.answer_question(item["device"], item["question_id"], "decline")
            elif verb == "answer":
                result = remote.answer(item["task"], text or "", item["question_id"], digest=item.get("digest"))
            else:
                result = remote.approve(item["task"], verb == "approve", digest=item.get("digest"))
    except RemoteError as exc:
        fail_remote(exc)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        console().print(f"{'approved' if verb == 'approve' else 'denied' if verb == 'deny' else 'answered'}: "
                        f"{escape(item['id'])} ({escape(str(item.get('question') or '')[:80])})")


@approvals_app.command("approve")
def approve_item(item_id: ItemArg, server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
                 as_json: JsonOpt = False) -> None:
    """Approve an inbox item: a task's action or plan, or a device's question (accepted)."""
    _act(item_id, "approve", None, server, token, ca_file, as_json)


@approvals_app.command("deny")
def deny_item(item_id: ItemArg, server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
              as_json: JsonOpt = False) -> None:
    """Deny an inbox item (a task's action: the task is cancelled; a device's question: declined)."""
    _act(item_id, "deny", None, server, token, ca_file, as_json)


@approvals_app.command("answer")
def answer_item(item_id: ItemArg, text: Annotated[str, typer.Argument(metavar="TEXT", help="the answer")],
                server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
                as_json: JsonOpt = False) -> None:
    """Answer an inbox item's question with TEXT (an option's number or words, or free text)."""
    _act(item_id, "answer", text, server, token, ca_file, as_json)


# -- webhooks -----------------------------------------------------------------------------------------


@webhooks_app.callback()
def webhooks(ctx: typer.Context, server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
             as_json: JsonOpt = False, output: OutputOpt = None) -> None:
    """Webhooks told of approvals needed, tasks finished or failed, devices offline."""
    if ctx.invoked_subcommand:
        return
    from tether.cli.views.table import Column, print_table
    from tether.client.rest import RemoteError

    as_json, wide = _output(output, as_json)
    try:
        with _remote(server, token, ca_file) as remote:
            hooks = remote.webhooks()
    except RemoteError as exc:
        fail_remote(exc)
    if as_json:
        typer.echo(json.dumps(hooks, indent=2))
        return
    columns = [Column("id"), Column("url", 1, flex=True, min_width=24), Column("events", 2, flex=True),
               Column("format", 3), Column("owner", 4)]
    cells = [[h["id"], escape(h["url"]), ", ".join(h["events"]), h["format"],
              "server" if h["server_wide"] else escape(h.get("owner") or "-")] for h in hooks]
    print_table(f"{len(hooks)} webhooks", columns, cells, wide)


@webhooks_app.command("add")
def add_webhook(url: Annotated[str, typer.Argument(metavar="URL", help="http:// or https:// URL to POST to")],
                event: Annotated[list[str] | None, typer.Option(
                    "--event", metavar="EVENT", help="approval.needed, task.finished, task.failed, device.offline "
                                                     "(repeat; default all)")] = None,
                fmt: Annotated[str, typer.Option("--format", metavar="slack|generic",
                                                 help="slack: a Slack incoming webhook's text and blocks")] = "generic",
                server_wide: Annotated[bool, typer.Option(
                    "--server-wide", help="the server's (every event; admin token) rather than your token's")] = False,
                server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
                as_json: JsonOpt = False) -> None:
    """Add a webhook and print its signing secret (shown once: keep it where the receiver checks signatures)."""
    from tether.client.rest import RemoteError

    try:
        with _remote(server, token, ca_file) as remote:
            made = remote.add_webhook(url, events=event, fmt=fmt, server_wide=server_wide)
    except RemoteError as exc:
        fail_remote(exc)
    if as_json:
        typer.echo(json.dumps(made, indent=2))
        return
    console().print(f"webhook {made['id']} added ({escape(made['url'])}, {', '.join(made['events'])})")
    console(err=True).print("its signing secret, shown once (docs/approvals.md says how to check a signature):")
    typer.echo(made["secret"])


@webhooks_app.command("rm")
def remove_webhook(webhook_id: WebhookArg, server: ServerOpt = None,
                   token: TokenOpt = None, ca_file: CaOpt = None) -> None:
    """Remove a webhook and its deliveries."""
    from tether.client.rest import RemoteError

    try:
        with _remote(server, token, ca_file) as remote:
            remote.remove_webhook(webhook_id)
    except RemoteError as exc:
        fail_remote(exc)
    console().print(f"webhook {escape(webhook_id)} removed")


@webhooks_app.command("deliveries")
def webhook_deliveries(webhook_id: WebhookArg,
                       limit: Annotated[int, typer.Option("--limit", "-n", min=1, max=500,
                                                          help="the latest this many")] = 20,
                       server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
                       as_json: JsonOpt = False) -> None:
    """A webhook's latest deliveries: event, status (pending, delivered, failed), attempts, last error."""
    from tether.cli.views.table import Column, print_table
    from tether.client.rest import RemoteError

    try:
        with _remote(server, token, ca_file) as remote:
            rows = remote.webhook_deliveries(webhook_id, limit)
    except RemoteError as exc:
        fail_remote(exc)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    columns = [Column("event"), Column("status"), Column("tries", 2), Column("when", 3),
               Column("last error", 1, flex=True)]
    cells = [[r["event"], r["status"], str(r["attempts"]), _ago(r["created_at"]),
              escape(r.get("last_error") or "-")] for r in rows]
    print_table(f"{len(rows)} deliveries of {webhook_id}", columns, cells)


@webhooks_app.command("test")
def test_webhook(webhook_id: WebhookArg, server: ServerOpt = None,
                 token: TokenOpt = None, ca_file: CaOpt = None) -> None:
    """Send a `ping` delivery to the webhook (see it with `tether webhooks deliveries ID`)."""
    from tether.client.rest import RemoteError

    try:
        with _remote(server, token, ca_file) as remote:
            remote.test_webhook(webhook_id)
    except RemoteError as exc:
        fail_remote(exc)
    console().print(f"ping queued for {escape(webhook_id)}; `tether webhooks deliveries {escape(webhook_id)}` "
                    "shows how it went")
