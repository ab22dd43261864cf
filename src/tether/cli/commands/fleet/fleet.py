"""Managing the fleet: `tether devices NAME` (`show`), `rm`, `rename` and `tag` (docs/fleet.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from tether.cli import completion as complete
from tether.cli.common import (
    CaOpt,
    ExitCode,
    JsonOpt,
    ServerOpt,
    TokenOpt,
    console,
    devices_app,
    fail,
    fail_remote,
)


@devices_app.command("show")
def show(name: Annotated[str, typer.Argument(help="the device", autocompletion=complete.devices)],
         server: ServerOpt = None, token: TokenOpt = None,
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
def remove(name: Annotated[str, typer.Argument(help="the device to forget", autocompletion=complete.devices)],
           server: ServerOpt = None,
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


@devices_app.command("rename")
def rename(old: Annotated[str, typer.Argument(help="the device's name", autocompletion=complete.devices)],
           new: Annotated[str, typer.Argument(help="its new name")], server: ServerOpt = None,
           token: TokenOpt = None, ca_file: CaOpt = None) -> None:
    """Rename an offline device: its tokens, key and tags follow (admin).

    Refused while it is connected, and while an API token is scoped to it by name. Start the device with
    the new name afterwards (its config's device.name, or --name)."""
    from rich.markup import escape

    from tether.client.rest import RemoteError, RemoteServer

    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            remote.change_device(old, new_name=new)
    except RemoteError as exc:
        fail_remote(exc, ExitCode.FAILED)
    console().print(f"renamed device {escape(old)} to {escape(new)}", soft_wrap=True)


@devices_app.command("tag")
def tag(name: Annotated[str, typer.Argument(help="the device", autocompletion=complete.devices)],
        add: Annotated[list[str] | None, typer.Option("--add", metavar="TAG", help="add this tag (repeatable)")] = None,
        remove: Annotated[list[str] | None, typer.Option("--remove", metavar="TAG",
                                                         help="remove this tag (repeatable)")] = None,
        server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None) -> None:
    """Add or remove a device's tags (admin); the server keeps them over the ones the device reports."""
    from rich.markup import escape

    from tether.client.rest import RemoteError, RemoteServer

    if not add and not remove:
        fail("give --add TAG or --remove TAG", ExitCode.USAGE)
    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            current = list(remote.device(name).get("tags") or [])
            gone = set(remove or [])
            wanted = [t for t in dict.fromkeys([*current, *(add or [])]) if t not in gone]
            done = remote.change_device(name, tags=wanted)
    except RemoteError as exc:
        fail_remote(exc, ExitCode.FAILED)
    console().print(f"{escape(name)}: tags {escape(', '.join(done.get('tags') or [])) or '(none)'}", soft_wrap=True)
