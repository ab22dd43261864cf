"""Enrolment in the CLI: `tether device --pair` on the device, `tether devices pending|approve|refuse` for the admin."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from tether.cli.common import (
    INTERRUPTED,
    CaOpt,
    ExitCode,
    JsonOpt,
    OutputOpt,
    ServerOpt,
    TokenOpt,
    console,
    devices_app,
    fail,
    fail_remote,
    output_mode,
)
from tether.client.rest import RemoteError, RemoteServer

if TYPE_CHECKING:
    from tether.device.config import DeviceConfig
    from tether.device.link.trust.enrolment import Enrolment

NO_CREDENTIAL = ("no device token: pass --token-file PATH, set TETHER_DEVICE_TOKEN, put server.token_file in the "
                 "config ('tether token create --device NAME' makes one), or pair with the server: tether device "
                 "--server URL --pair")


def enrol(cfg: DeviceConfig, server: str | None, state_dir: Path | None, name: str | None, ca_file: str | None,
          tls_fingerprint: str | None, pair: bool) -> Enrolment:
    """The token a past pairing left in the state directory, else (with --pair) a new pairing."""
    from tether.device.link.trust.device_key import load_device_key
    from tether.device.link.trust.enrolment import PairingFailed, load_enrolment, save_enrolment
    from tether.device.link.trust.tls_pin import normalize_fingerprint
    from tether.tools.context import default_state_dir

    out = console(err=True)
    root = Path(state_dir or cfg.device.state_dir or default_state_dir()).expanduser()
    try:
        pin = normalize_fingerprint(tls_fingerprint) if tls_fingerprint else None
        enrolment = load_enrolment(root)
    except ValueError as exc:
        fail(str(exc))
    if enrolment is not None:
        if pair:
            out.print(f"already paired as {enrolment.name} (token in {root / 'device.token'}; remove it to pair "
                      "again)", soft_wrap=True)
        return enrolment
    if not pair:
        fail(NO_CREDENTIAL)
    url = server or cfg.server.ws_url()

    def show_code(code: str, fingerprint: str) -> None:
        out.print(f"pairing code: [bold]{code}[/bold]   device fingerprint: {fingerprint[:16]}", soft_wrap=True)
        out.print(f"waiting for an admin to run: tether devices approve {code} [--name NAME] [--tag TAG]",
                  soft_wrap=True, markup=False)

    async def run() -> Enrolment:
        from tether.device.link.trust.enrolment import pair as ask
        from tether.device.link.trust.enrolment import tls_for_pairing

        context, pinned = await tls_for_pairing(url, ca_file or cfg.server.ca_file, pin,
                                                lambda text: out.print(f"note: {escape(text)}", soft_wrap=True))
        key = load_device_key(cfg.server.key_path(root, Path(cfg.source).parent if cfg.source else None))
        got = await ask(url, root, name=name or cfg.device.name, ssl_context=context, show_code=show_code, key=key)
        got.server, got.tls_fingerprint = url, pinned
        return got

    try:
        enrolment = asyncio.run(run())
    except KeyboardInterrupt:
        fail("pairing stopped before an admin approved it", INTERRUPTED)
    except PairingFailed as exc:
        fail(str(exc), 3)
    except ValueError as exc:  # a pin that does not match, a bad URL
        fail(str(exc), 3)
    except OSError as exc:
        fail(f"cannot reach the server at {url} to pair: {exc}")
    save_enrolment(root, enrolment)
    out.print(f"[green]paired as {escape(enrolment.name or '?')}[/green]; token kept in {root / 'device.token'}",
              soft_wrap=True)
    return enrolment


def _remote(server: str | None, token: str | None, ca_file: str | None) -> RemoteServer:
    return RemoteServer(server, token, ca_file=ca_file)


@devices_app.command("pending")
def pending(server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None, as_json: JsonOpt = False,
            output: OutputOpt = None) -> None:
    """Devices waiting to pair: their code, fingerprint, address and the name they asked for (marked TAKEN
    when another device holds it: approving under it needs --replace)."""
    from tether.cli.views.table import Column, print_table

    as_json, wide = output_mode(output, as_json)
    try:
        with _remote(server, token, ca_file) as remote:
            rows = remote.pairing_requests()
    except RemoteError as exc:
        fail_remote(exc, ExitCode.USAGE)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    # the code is what `devices approve` takes and the fingerprint what a person compares: never cut
    columns = [Column("code"), Column("fingerprint"), Column("name asked", flex=True, min_width=24),
               Column("platform", 3), Column("address", 2), Column("expires in", 1)]
    cells = []
    now = time.time()
    for r in rows:
        asked = escape(r.get("requested_name") or "-")
        if r.get("collision"):
            asked += " [bold red](TAKEN: another device has this name; --name or --replace)[/bold red]"
        cells.append([escape(r["code"]), escape(r["fingerprint"][:16]), asked, escape(r.get("platform") or "-"),
                      escape(r["address"]), f"{max(0, r['expires_at'] - now):.0f}s"])
    print_table(f"{len(rows)} pairing request(s)", columns, cells, wide)
    for r in rows:
        if r.get("collision"):
            console(err=True).print(f"warning: {escape(r['code'])}: {escape(r['collision'])}", soft_wrap=True)


@devices_app.command("approve")
def approve(code: Annotated[str, typer.Argument(help="the code the device shows")],
            name: Annotated[str | None, typer.Option(
                "--name", help="the device's name (default: what it asked)")] = None,
            tag: Annotated[list[str] | None, typer.Option("--tag", help="a tag for the device (repeat)")] = None,
            replace: Annotated[bool, typer.Option(
                "--replace", help="the name belongs to an existing device: replace it (its tokens are revoked and "
                                  "its key is replaced by this device's); without it a taken name is refused")] = False,
            server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None) -> None:
    """Let a pairing device in: its key becomes the device, it receives a device token and registers (admin scope)."""
    try:
        with _remote(server, token, ca_file) as remote:
            done = remote.approve_pairing(code, name, tag or [], replace=replace)
    except RemoteError as exc:
        fail_remote(exc, ExitCode.USAGE)
    console().print(f"approved {escape(done['code'])}: the device joins as {escape(done['name'])}"
                    + (f" with tags {escape(', '.join(done['tags']))}" if done.get("tags") else "")
                    + (f"; it replaces the previous {escape(done['name'])} ({done.get('revoked_tokens', 0)} token(s) "
                       "revoked)" if done.get("replaced") else ""), soft_wrap=True)


@devices_app.command("refuse")
def refuse(code: Annotated[str, typer.Argument(help="the code the device shows")],
           server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None) -> None:
    """Refuse a pairing request: the device is told and gets nothing (admin scope)."""
    try:
        with _remote(server, token, ca_file) as remote:
            remote.refuse_pairing(code)
    except RemoteError as exc:
        fail_remote(exc, ExitCode.USAGE)
    console().print(f"refused {code}")
