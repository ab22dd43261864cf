"""`tether audit`: the server's audit log in the terminal, filtered server-side (GET /api/v1/audit)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from tether.cli.common import CaOpt, ExitCode, JsonOpt, ServerOpt, TokenOpt, app, console, fail, fail_remote

_PAGE = 500  # the endpoint's largest page


def _when(text: str | None, option: str) -> float | None:
    """Unix seconds, an ISO date/time, or an age such as 30m, 2h, 7d (that long ago)."""
    if text is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
            return time.time() - float(text[:-1]) * units[text[-1]]
        try:
            return float(text)
        except ValueError:
            return datetime.fromisoformat(text).timestamp()
    except ValueError:
        fail(f"{option} {text!r}: give unix seconds, an ISO time (2026-11-23T10:00) or an age (30m, 2h, 7d)")


@app.command("audit", rich_help_panel="Server")
def audit(device: Annotated[str | None, typer.Option("--device", "-d", help="only this device's rows")] = None,
          task: Annotated[str | None, typer.Option("--task", help="only this task's commands (id or prefix)")] = None,
          by_token: Annotated[str | None, typer.Option("--by-token", help="only what this API token's name "
                                                      "asked for, itself or through its tasks")] = None,
          since: Annotated[str | None, typer.Option("--since", help="from this time: unix seconds, ISO, or an "
                                                    "age like 2h")] = None,
          until: Annotated[str | None, typer.Option("--until", help="before this time (same forms)")] = None,
          limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="at most this many rows")] = 50,
          server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None, as_json: JsonOpt = False) -> None:
    """Show the server's audit log, newest first: every command sent to a device, who asked, its outcome."""
    from tether.client.rest import RemoteError, RemoteServer

    params: dict[str, Any] = {k: v for k, v in (("device", device), ("task", task), ("token", by_token),
                                                ("since", _when(since, "--since")),
                                                ("until", _when(until, "--until"))) if v is not None}
    rows: list[dict[str, Any]] = []
    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            before = None
            while len(rows) < limit:  # page with the cursor until enough rows or none left
                page = remote._request("GET", "/audit", params={**params, "limit": min(_PAGE, limit - len(rows)),
                                                                 **({"before": before} if before else {})})
                rows += page["rows"]
                before = page["next"]
                if before is None:
                    break
    except RemoteError as exc:
        fail_remote(exc, ExitCode.USAGE)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title=f"{len(rows)} audit rows")
    for col in ("id", "at", "device", "requested by", "tool", "status", "arguments / error"):
        table.add_column(col, overflow="fold")
    for r in rows:
        at = datetime.fromtimestamp(r["at"]).strftime("%Y-%m-%d %H:%M:%S")
        detail = r.get("error") or r.get("arguments") or ""
        table.add_row(str(r["id"]), at, escape(r["device"]), escape(r["requested_by"]), escape(r["tool_name"]),
                      escape(r["status"]), escape(detail[:200]))
    console().print(table)


@app.command("batch", rich_help_panel="Server")
def batch(batch_id: Annotated[str, typer.Argument(help="the batch's id (an 'outcome pending' answer names it)")],
          server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None, as_json: JsonOpt = False) -> None:
    """Show a batch's record: each command's outcome, also one that came back after its caller stopped
    waiting. Exit code 3 while an outcome is still pending (docs/outcomes.md)."""
    from tether.client.rest import RemoteError, RemoteServer

    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            record = remote.batch(batch_id)
    except RemoteError as exc:
        fail_remote(exc, ExitCode.FAILED)
    if as_json:
        typer.echo(json.dumps(record, indent=2))
    else:
        out = console()
        out.print(f"batch {escape(record['batch_id'])} on device {escape(record['device'])}, asked by "
                  f"{escape(record['requested_by'])}: [bold]{record['state']}[/bold] ({escape(record['note'])})",
                  soft_wrap=True)
        table = Table()
        for col in ("call_id", "tool", "status", "error"):
            table.add_column(col, overflow="fold")
        for c in record["commands"]:
            status = "outcome pending" if c["status"] in ("sent", "pending", "unknown") else c["status"]
            table.add_row(escape(str(c["call_id"])), escape(c["tool_name"]),
                          escape(status + (" (late)" if c["late"] else "")), escape((c["error"] or "")[:300]))
        out.print(table)
    if record["state"] != "done":
        raise typer.Exit(ExitCode.WAITING)
