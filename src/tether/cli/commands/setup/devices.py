"""`tether devices`: the server's devices, as a table or JSON."""

from __future__ import annotations

import json
import time

import typer

from tether.cli.common import (
    CaOpt,
    ExitCode,
    JsonOpt,
    OutputOpt,
    ServerOpt,
    TokenOpt,
    devices_app,
    fail_remote,
    output_mode,
)


@devices_app.callback(invoke_without_command=True)
def devices(ctx: typer.Context, server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
            as_json: JsonOpt = False, output: OutputOpt = None) -> None:
    """Show the server's devices: name, platform, status, (in a cluster) the node holding it, last seen, load,
    sandbox, capabilities (-o wide: every column at any terminal width)."""
    if ctx.invoked_subcommand:
        return
    from rich.markup import escape

    from tether.cli.views.table import Column, print_table
    from tether.client.rest import RemoteError, RemoteServer  # httpx: not for `tether device` or `tether server`

    as_json, wide = output_mode(output, as_json)
    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            rows = remote.devices()
    except RemoteError as exc:
        fail_remote(exc, ExitCode.USAGE)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    clustered = any(r.get("node") for r in rows)  # a cluster's node: which one holds each device's socket
    # name and status never cut; then what tells devices apart, the counters dropped first
    columns = [Column("name"), Column("platform", 1), Column("status"), *((Column("node", 3),) if clustered else ()),
               Column("last seen", 2), Column("load", 5), Column("running", 6), Column("queued", 6),
               Column("sandbox", 4), Column("tags", 3), Column("capabilities", 7, flex=True)]
    cells = []
    now = time.time()
    for r in rows:
        seen = f"{now - r['last_seen']:.0f}s ago" if r.get("last_seen") else "-"
        style = {"online": "green", "busy": "yellow", "offline": "red"}.get(r["status"], "white")
        node = (escape(r.get("node") or "-"),) if clustered else ()
        cells.append([escape(r["name"]), escape(r.get("platform") or "-"), f"[{style}]{escape(r['status'])}[/{style}]",
                      *node, seen, str(r.get("load", 0)), str(r.get("running", 0)), str(r.get("queued", 0)),
                      _sandbox_cell(r.get("sandbox")), escape(", ".join(r.get("tags") or [])) or "-",
                      ", ".join(r.get("capabilities", [])) + (" gpu" if r.get("gpu") else "")])
    print_table(f"{len(rows)} devices", columns, cells, wide)


def _sandbox_cell(kind: str | None) -> str:
    if kind is None:
        return "-"  # not reported (offline before it registered, or an older device)
    return "[yellow]none[/yellow]" if kind == "none" else kind
