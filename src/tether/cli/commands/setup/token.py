"""`tether token …`: create, rotate, list and revoke device and API tokens."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from tether.cli import completion as complete
from tether.cli.commands.setup.settings import DbOpt, _settings
from tether.cli.common import JsonOpt, OutputOpt, console, fail, output_mode, token_app

KeyOpt = Annotated[str | None, typer.Option(
    "--key", metavar="PUBLIC_KEY", help="a device's public key, as 'tether device key' prints it on the device: "
                                        "only that key can use the token")]


@token_app.command("create")
def token_create(device: Annotated[list[str] | None, typer.Option(
                     "--device", metavar="NAME", help="a device token for NAME; with --api, a device (name or "
                                                      "glob) the API token reaches (repeat; default every device)")
                 ] = None,
                 tag: Annotated[list[str] | None, typer.Option(
                     "--tag", metavar="TAG", help="with --api: the token also reaches the devices with this tag "
                                                  "(repeat)")] = None,
                 api: Annotated[str | None, typer.Option(
                     "--api", metavar="NAME", help="an API token named NAME")] = None,
                 scope: Annotated[list[str] | None, typer.Option("--scope", metavar="SCOPE",
                                                                 help="read, execute, approve "
                                                                 "(answer approvals), admin, sample (its "
                                                                 "commands' MCP servers may use the LLM) "
                                                                 "(repeat; default read+execute)")] = None,
                 confirm: Annotated[str, typer.Option("--confirm", metavar="never|destructive|always",
                                                      help="an API token: which plans of the tasks it creates "
                                                           "wait for 'tether approve TASK' before they run "
                                                           "(destructive: plans with a step that changes "
                                                           "something)")] = "never",
                 agent: Annotated[bool, typer.Option(
                     "--agent", help="an API token an agent (an MCP client, a script an LLM drives) holds: it may "
                                     "read and run, never approve (no approve or admin scope)")] = False,
                 admin: Annotated[bool, typer.Option(
                     "--admin", help="the first admin token: --api admin with every scope, saved to "
                                     "~/.config/tether/token (mode 0600), where the CLI reads it")] = False,
                 save: Annotated[Path | None, typer.Option(
                     "--save", metavar="FILE", help="write the token to FILE (created with mode 0600, never "
                                                    "overwritten) instead of printing it")] = None,
                 key: KeyOpt = None, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Create a token and print it once (only its hash is stored). An API token is a person's unless
    --agent says it is an agent's; only a person's token approves.

    A device token works only with its device's key: --key's, one enrolled already, or its first registration's."""
    from tether.server.store import Store
    from tether.server.trust.device_keys import device_key, set_device_key

    if admin:  # the first hour: a person's token that may do everything, kept where the CLI looks for it
        if agent or device or tag or scope:
            fail("--admin makes a person's token with every scope for every device: give no --agent, --device, "
                 "--tag or --scope with it")
        from tether.client.rest import token_file_path

        api, scope = api or "admin", ["read", "execute", "approve", "admin"]
        save = save or Path(token_file_path())
    if save is not None and as_json:
        fail("--save writes the token to a file; --json would print it: give one of them")
    if save is not None:
        save = save.expanduser().absolute()
        if save.exists():
            fail(f"{save} exists: a token file is never overwritten (remove it, or --save another FILE)")
        try:
            save.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            fail(f"cannot create {save.parent}: {exc.strerror or exc}")
    if not api and (len(device or []) != 1 or tag):
        fail("give --device NAME (a device token) or --api NAME (an API token, which --device and --tag scope)")
    if key and api:
        fail("--key is a device's public key: give it with --device NAME and no --api")
    if agent and not api:
        fail("--agent goes with --api: a device token is a device's, not an agent's")
    store = Store(_settings(db_path=db).db_target)
    try:
        kind = "api" if api else "device"
        name = api or (device or [""])[0]
        enrolled = device_key(store, name) if kind == "device" else None
        if key and enrolled is not None and enrolled.public_key != _public_key(key):
            fail(f"device '{name}' has another key (enrolled by {enrolled.enrolled_by}); to give it a new key "
                 f"use: tether token rotate --device {name} --key PUBLIC_KEY")
        scopes = list(scope or ["read", "execute"]) if api else []
        info, secret = store.tokens.create(kind, name, scopes, confirm,  # type: ignore[arg-type]
                                          devices=list(device or []) if api else [], tags=list(tag or []),
                                          agent=agent)
        if key and kind == "device" and enrolled is None:
            set_device_key(store, name, _public_key(key), "admin")
            enrolled = device_key(store, name)
    except ValueError as exc:
        fail(str(exc))
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps({"token": secret, "id": info.id, "kind": info.kind, "name": info.name,
                               "scopes": info.scopes, "confirm": info.confirm, "devices": info.devices,
                               "tags": info.tags, "agent": info.agent,
                               **({"key_fingerprint": _key_print(enrolled)} if kind == "device" else {})}))
        return
    reach = f", reaching {info.scope_text()}" if info.scoped else ""
    whose = " (an agent's: it never approves)" if info.agent else ""
    if save is not None:
        _save_secret(save, secret, info.id, db)
        from tether.client.rest import token_file_path

        if kind == "device":
            read = f"use it with: tether device --name {info.name} --token-file {save} --server URL"
        elif str(save) == token_file_path():
            read = "the CLI reads it from there when TETHER_TOKEN is unset"
        else:
            read = f'use it with: export TETHER_TOKEN="$(cat {save})"'
        console(err=True).print(f"{kind} token{whose} for '{info.name}' (id {info.id}"
                                f"{', scopes ' + ','.join(info.scopes) if info.scopes else ''}{reach}) saved to "
                                f"{save} (mode 0600); {read}", markup=False, soft_wrap=True)
        return
    console(err=True).print(f"{kind} token{whose} for '{info.name}' (id {info.id}"
                            f"{', scopes ' + ','.join(info.scopes) if info.scopes else ''}{reach}); "
                            "it is shown only once:", markup=False)
    if kind == "device":
        console(err=True).print(_key_note(info.name, enrolled), soft_wrap=True, markup=False)
    typer.echo(secret)


def _save_secret(path: Path, secret: str, token_id: str, db: str | None) -> None:
    """Write the secret to a new file only its owner may read; on failure the token is revoked (nobody has it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(secret + "\n")
    except OSError as exc:
        from tether.server.store import Store

        store = Store(_settings(db_path=db).db_target)
        try:
            store.tokens.revoke_id(token_id)
        finally:
            store.close()
        fail(f"cannot write {path}: {exc.strerror or exc}; the token was revoked")


def _public_key(text: str) -> str:
    """A public key as given on the command line, checked (ValueError says what is wrong)."""
    from tether.protocol.identity import valid_public_key

    key = text.strip()
    if not valid_public_key(key) or len(key) != 43:
        raise ValueError(f"{key[:60]!r} is not a device public key (43 characters of unpadded base64url, as "
                         "'tether device key' prints it)")
    return key


def _key_print(enrolled: Any) -> str | None:
    from tether.protocol.identity import fingerprint

    return fingerprint(enrolled.public_key) if enrolled is not None else None


def _key_note(device: str, enrolled: Any) -> str:
    if enrolled is None:
        return (f"no key is enrolled for '{device}': the first registration with this token enrols the key it "
                "proves, and only that key can use it afterwards")
    return (f"only the key {(_key_print(enrolled) or '')[:16]} (enrolled by {enrolled.enrolled_by}) can use it; "
            f"for another machine: tether token rotate --device {device} --key PUBLIC_KEY (or --reset-key)")


@token_app.command("rotate")
def token_rotate(device: Annotated[str, typer.Option("--device", metavar="NAME", help="the device")],
                 key: KeyOpt = None,
                 reset_key: Annotated[bool, typer.Option(
                     "--reset-key", help="forget the device's key: the first registration with the new token enrols "
                                         "the key it proves (a device that made a new key, or a new machine)")] = False,
                 db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Give a device a new token (and with --key or --reset-key a new key): its old tokens stop working
    at once, and a connected device using one is disconnected at the server's next token check."""
    from tether.server.store import Store
    from tether.server.trust.device_keys import device_exists, device_key, revoke_device_tokens, set_device_key

    if key and reset_key:
        fail("give --key PUBLIC_KEY or --reset-key, not both")
    store = Store(_settings(db_path=db).db_target)
    try:
        if not device_exists(store, device):
            fail(f"no device '{device}' (no token, key or registration): create one with "
                 f"tether token create --device {device}", code=1)
        new_key = _public_key(key) if key else None
        revoked = revoke_device_tokens(store, device)
        info, secret = store.tokens.create("device", device)
        if new_key or reset_key:
            set_device_key(store, device, new_key, "admin (rotate)")
        enrolled = device_key(store, device)
    except ValueError as exc:
        fail(str(exc))
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps({"token": secret, "id": info.id, "name": device, "revoked": revoked,
                               "key_fingerprint": _key_print(enrolled)}))
        return
    console(err=True).print(f"device token for '{device}' (id {info.id}); {revoked} old token(s) revoked; it is shown "
                            "only once:", soft_wrap=True, markup=False)
    console(err=True).print(_key_note(device, enrolled), soft_wrap=True, markup=False)
    typer.echo(secret)


@token_app.command("list")
def token_list(db: DbOpt = None, as_json: JsonOpt = False, output: OutputOpt = None) -> None:
    """List tokens (never their secrets)."""
    from tether.cli.views.table import Column, print_table
    from tether.server.store import Store

    as_json, wide = output_mode(output, as_json)
    store = Store(_settings(db_path=db).db_target)
    try:
        rows = store.tokens.all()
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
        return
    from rich.markup import escape

    # id and name are what `token revoke` takes: never cut; the rest dropped from the least needed
    columns = [Column("id"), Column("kind", 1), Column("holder", 4), Column("name"), Column("scopes", 2),
               Column("reaches", 5, flex=True), Column("created", 6), Column("revoked", 3)]
    cells = []
    for r in rows:
        holder = "device" if r.kind == "device" else "agent" if r.agent else "person"
        reach = r.scope_text() if r.scoped else ("every device" if r.kind == "api" else "-")
        cells.append([str(r.id), r.kind, holder, escape(r.name), ",".join(r.scopes), escape(reach),
                      _when(r.created_at), _when(r.revoked_at)])
    print_table("tokens", columns, cells, wide)


@token_app.command("revoke")
def token_revoke(token: Annotated[str, typer.Argument(help="token id, or a name (revokes all its tokens)",
                                                     autocompletion=complete.tokens)],
                 db: DbOpt = None) -> None:
    """Revoke a token; a connected device using it is refused at its next registration."""
    from tether.server.store import Store

    store = Store(_settings(db_path=db).db_target)
    try:
        count = store.tokens.revoke(token)
    finally:
        store.close()
    if not count:
        fail(f"no active token '{token}'", code=1)
    console().print(f"revoked {count} token(s)")


def _when(stamp: float | str | None) -> str:
    if stamp is None:
        return "-"
    if isinstance(stamp, (int, float)):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))
    return str(stamp)
