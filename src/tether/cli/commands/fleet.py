"""Managing the fleet: `tether devices NAME` (`show`) and `tether devices rm NAME` (docs/fleet.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from tether.cli.common import (
    CaOpt,
    ExitCode,
    JsonOpt,
    ServerOpt,
    TokenOpt,
    console,
    devices_app,
    fail_remote,
)


@devices_app.command("show")
def show(name: Annotated[str, typer.Argument(help="the device")], server: ServerOpt = None, token: TokenOpt = None,
         ca_file: CaOpt = None, as_json: JsonOpt = False) -> None:
    """One device in detail (`tether devices NAME` is the same).

    Status, last seen, platform, cpu, memory, tools count, tags and key fingerprint."""
    import json

    from tether.cli.views.device_detail import detail_grid, detail_lines
    from tether.cli.views.safe_text import SafeConsole
    from tether.client.rest import RemoteError, RemoteServer

    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            device = remote.device(name)
            try:
                key = remote.device_key(name)
            except RemoteError:
                key = None  # an older server: the view goes without the key
    except RemoteError as exc:
        fail_remote(exc, ExitCode.FAILED)
    if as_json:
        typer.echo(json.dumps({**device, "key": key}, indent=2))
        return
    SafeConsole(highlight=False).print(detail_grid(detail_lines(device, key)))


@devices_app.command("rm")
def remove(name: Annotated[str, typer.Argument(help="the device to forget")], server: ServerOpt = None,
           token: TokenOpt = None, ca_file: CaOpt = None, as_json: JsonOpt = False) -> None:
    """Forget a device: revoke its tokens and key, disconnect it, drop it from the list (admin).

    It comes back only by pairing or a new token, and it leaves every fan-out. Its audit rows stay, with
    one more saying who removed it. Needs an admin token that reaches every device."""
    import json

    from rich.markup import escape

    from tether.client.rest import RemoteError, RemoteServer

    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            done = remote.remove_device(name)
    except RemoteError as exc:
        fail_remote(exc, ExitCode.FAILED)
    if as_json:
        typer.echo(json.dumps(done, indent=2))
        return
    console().print(f"removed device {escape(name)} (was {escape(str(done.get('was')))}; "
                    f"{done.get('revoked_tokens', 0)} token(s) revoked)", soft_wrap=True)
