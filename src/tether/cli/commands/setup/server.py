"""`tether server`, `tether token …`, `tether device` and `tether devices`."""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tether.cli import completion as complete
from tether.cli.common import (
    CaOpt,
    ConfigOpt,
    ExitCode,
    JsonOpt,
    OutputOpt,
    PolicyOpt,
    ServerOpt,
    StateOpt,
    TokenOpt,
    console,
    device_app,
    devices_app,
    fail,
    fail_remote,
    output_mode,
    say,
    server_app,
    token_app,
)

if TYPE_CHECKING:
    from tether.device.config import DeviceConfig

DbOpt = Annotated[str | None, typer.Option(
    "--db", metavar="PATH|URL", help="server database: a SQLite file (default: state dir/server.db) or a "
                                     "postgresql://USER@HOST:PORT/DB URL shared by several servers "
                                     "(default $TETHER_DB_URL; a password goes in ~/.pgpass or PGPASSWORD)")]

def _settings(**overrides: object):
    from tether.server.settings import ServerSettings
    from tether.server.store.engine import is_url

    clean = {k: v for k, v in overrides.items() if v is not None}
    if "db_path" not in clean and os.environ.get("TETHER_DB_URL") and "db_path" in overrides:
        clean["db_path"] = os.environ["TETHER_DB_URL"]
    if "db_path" in clean:
        if is_url(str(clean["db_path"])):
            clean["db_url"] = str(clean.pop("db_path"))
        else:
            clean["db_path"] = str(Path(str(clean["db_path"])).expanduser())
    from pydantic import ValidationError

    try:
        return ServerSettings(**clean)
    except ValidationError as exc:  # one line per problem, named by its option, not pydantic's report
        fail("; ".join(f"{'.'.join(map(str, e['loc'])) or 'server settings'}: "
                       f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors()))
    except ValueError as exc:
        fail(str(exc))


def _set_options(pairs: list[str]) -> dict[str, str]:
    """`--set KEY=VALUE` options as settings (validated with the rest by `ServerSettings`)."""
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            fail(f"--set {pair!r}: write it KEY=VALUE, e.g. --set idle_timeout=5")
        values[key.strip()] = value.strip()
    return values


def _config_webhooks(config: Path | None) -> list[dict[str, object]]:
    """The `webhooks:` list of the config file (`config`, else the default one when it exists); [] without."""
    from tether.agent.llm.chat import default_config_path

    file = config.expanduser() if config is not None else default_config_path()
    if not file.is_file():
        return []
    import yaml

    from tether import yaml12

    try:
        data = yaml12.safe_load(file.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        fail(f"cannot read config file {file}: {exc}")
    hooks = data.get("webhooks") if isinstance(data, dict) else None
    if hooks is None:
        return []
    if not isinstance(hooks, list) or not all(isinstance(h, dict) for h in hooks):
        fail(f"config file {file}: webhooks: must be a list of entries with url, secret, format, events")
    return hooks


@server_app.callback(invoke_without_command=True)
def server(ctx: typer.Context, config: Annotated[Path | None, typer.Option(
               "--config", "-c", metavar="FILE", help="the config file whose llm: section plans tasks "
                                                       "(default $TETHER_CONFIG or ~/.config/tether/config.yaml)")
           ] = None,
           host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
           port: Annotated[int, typer.Option(help="port")] = 8765, db: DbOpt = None,
           tls_cert: Annotated[Path | None, typer.Option(
               "--tls-cert", help="PEM certificate (chain): serve HTTPS and wss")] = None,
           tls_key: Annotated[Path | None, typer.Option("--tls-key", help="PEM private key of --tls-cert")] = None,
           heartbeat_interval: Annotated[float | None, typer.Option(help="seconds")] = None,
           heartbeat_timeout: Annotated[float | None, typer.Option(help="seconds")] = None,
           grace_period: Annotated[float | None, typer.Option(help="seconds a dropped device's batches wait")] = None,
           allow_insecure: Annotated[bool, typer.Option(help="allow plain HTTP off loopback")] = False,
           allowed_host: Annotated[list[str] | None, typer.Option(
               "--allowed-host", help="a host name clients may use (Host and Origin headers) besides localhost, "
                                      "127.0.0.1, [::1] and the bind address; '*.example.com' for subdomains "
                                      "(repeat)")] = None,
           max_body_bytes: Annotated[int | None, typer.Option(
               help="largest request body accepted with a valid API token (default 4 MiB)")] = None,
           max_response_bytes: Annotated[int | None, typer.Option(
               help="largest REST answer with a batch's results (default 32 MiB); past it the largest results "
                    "become too-large failures")] = None,
           pairing: Annotated[bool, typer.Option(
               "--pairing/--no-pairing", help="let devices without a token ask to pair (an admin approves each)")
           ] = True,
           four_eyes: Annotated[bool, typer.Option(
               "--four-eyes", help="approvals need a second person: the token that asked for an action may not "
                                   "approve it (docs/security/approvals.md)")] = False,
           cluster: Annotated[str | None, typer.Option(
               "--cluster", metavar="REDIS_URL", envvar="TETHER_CLUSTER",
               help="run as one node of a cluster on this Redis (redis://HOST:PORT/DB), sharing --db (a "
                    "postgresql:// URL) with the other nodes; see docs/scaling.md")] = None,
           node_id: Annotated[str | None, typer.Option(
               "--node-id", metavar="NAME", help="this node's name in the cluster (default: host name and a "
                                                 "digest of the state directory and database)")] = None,
           allowed_origin: Annotated[list[str] | None, typer.Option(
               "--allowed-origin", metavar="URL", help="a browser origin (scheme://host[:port]) allowed to call "
                                                       "the server besides its own (repeat)")] = None,
           setting: Annotated[list[str] | None, typer.Option(
               "--set", metavar="KEY=VALUE", help="any other server setting, e.g. idle_timeout=5, "
                                                  "max_sockets_per_address=5000 (repeat; docs/security/edge.md)")
           ] = None,
           log_level: Annotated[str, typer.Option(metavar="debug|info|warning|error",
                                                  help="server log detail")] = "info") -> None:
    """Start the agent server (AIP WebSocket endpoint /aip and the REST API under /api/v1)."""
    if ctx.invoked_subcommand:
        return
    from functools import partial

    from tether.agent.llm.chat import resolve_llm_settings
    from tether.agent.server_app import create_agent_app
    from tether.server.main import PortInUse, UnsafeBinding, claim_state, run_server
    from tether.server.store import check_state_dir

    if bool(tls_cert) != bool(tls_key):
        fail("--tls-cert and --tls-key go together")
    named: dict[str, object] = dict(
        host=host, port=port, db_path=db, tls_cert=str(tls_cert) if tls_cert else None,
        tls_key=str(tls_key) if tls_key else None, heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout, grace_period=grace_period, allowed_hosts=allowed_host or None,
        max_body_bytes=max_body_bytes, max_response_bytes=max_response_bytes, pairing=pairing, cluster_url=cluster,
        node_id=node_id, allowed_origins=allowed_origin or None, four_eyes=four_eyes or None)
    for key, value in _set_options(setting or []).items():
        if named.get(key) is not None:
            fail(f"--set {key}: give it with its own option (tether server --help)")
        named[key] = value
    named["webhooks"] = _config_webhooks(config) or None  # the config file's webhooks: (docs/approvals.md)
    settings = _settings(**named)
    if settings.cluster_url:
        try:
            import redis  # noqa: F401 - only to say clearly that it is missing
        except ImportError:
            fail("--cluster needs the redis package: pip install 'tether[cluster]'")
    try:  # one server per state: its lease, then its port, before anything is read or written
        claim = claim_state(settings)  # another server holds it: StateBusy, one line (tether.cli.main), exit 2
    except PortInUse as exc:
        fail(str(exc))
    check_state_dir(settings.db_target)  # a full or read-only state directory: one line (tether.cli.main), exit 2
    _first_admin_hint(settings.db_target, db)
    if tls_cert:
        _print_cert_fingerprint(tls_cert)
    try:
        llm = resolve_llm_settings(config)
    except ValueError as exc:
        fail(str(exc))
    console(err=True).print(f"planning with {llm.model} at {llm.base_url}" if llm else
                            "no LLM configured (TETHER_LLM_BASE_URL, TETHER_LLM_MODEL or the config file's llm: "
                            "section): tasks need a plan", markup=False)
    try:
        run_server(settings, allow_insecure=allow_insecure, log_level=log_level,
                   app_factory=partial(create_agent_app, llm_settings=llm), claim=claim)
    except UnsafeBinding as exc:
        fail(str(exc))


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

    A device token works only with its device's key: --key's, one enrolled already, or its first registration's.
    """
    from tether.server.device_keys import device_key, set_device_key
    from tether.server.store import Store

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

        read = ("the CLI reads it from there when TETHER_TOKEN is unset" if str(save) == token_file_path()
                else f'use it with: export TETHER_TOKEN="$(cat {save})"')
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


def _first_admin_hint(target: str | Path, db: str | None) -> None:
    """On a server with no person's admin token yet, say how to make the first one (pairing, policy, audit,
    webhooks and `mcp config` all need one)."""
    from tether.server.store import Store

    store = Store(target)
    try:
        made = any(t.active and t.kind == "api" and not t.agent and t.allows("admin") for t in store.tokens.all())
    finally:
        store.close()
    if not made:
        where = "" if not db else f" --db {shlex.quote(db)}" if "://" not in db else " --db <the same URL>"
        console(err=True).print(f"no admin token yet: on this machine, run `tether token create --admin{where}`; it is "
                                "saved to ~/.config/tether/token (mode 0600), where the CLI looks for it (the "
                                "dashboard takes it at login)", markup=False, soft_wrap=True)


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
    from tether.server.device_keys import device_exists, device_key, revoke_device_tokens, set_device_key
    from tether.server.store import Store

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


def _sandbox_cell(kind: str | None) -> str:
    if kind is None:
        return "-"  # not reported (offline before it registered, or an older device)
    return "[yellow]none[/yellow]" if kind == "none" else kind


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


DEVICE_TOKEN_ENV = "TETHER_DEVICE_TOKEN"  # noqa: S105 (a variable name)
REFUSED_ON_COMMAND_LINE = (
    "--token is not accepted: a token on a command line is visible to every user of the machine "
    "(ps, /proc/PID/cmdline); use --token-file PATH or the TETHER_DEVICE_TOKEN environment variable")


def _scrub_initial_environ(name: str) -> bool:
    """Overwrite the value of `name=…` in this process's environment strings, in place. True if done.

    Removing a variable (os.environ.pop → unsetenv) only takes libc's *pointer* to the "NAME=value"
    string out of the `environ` array; the bytes stay where the kernel put them at exec, in the
    initial environment block on the stack, and /proc/PID/environ (readable by the same user, hence
    by anything the device starts outside a sandbox) is read by the kernel from exactly that block.
    So while `environ` still points at the string, zero its value bytes through ctypes; then unsetenv.
    Linux (glibc or musl, which export `environ`) only; elsewhere there is no /proc/PID/environ.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        environ = ctypes.POINTER(ctypes.c_void_p).in_dll(libc, "environ")
    except (OSError, ValueError):
        return False
    libc.strncmp.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)
    libc.strncmp.restype = ctypes.c_int
    libc.strlen.argtypes = (ctypes.c_void_p,)
    libc.strlen.restype = ctypes.c_size_t
    prefix = name.encode() + b"="
    done = False
    index = 0
    while (entry := environ[index]) is not None:  # NULL ends the array
        if libc.strncmp(entry, prefix, len(prefix)) == 0:
            length = libc.strlen(entry)
            ctypes.memset(entry + len(prefix), 0, length - len(prefix))
            done = True
        index += 1
    return done


def take_device_token_from_env(name: str = DEVICE_TOKEN_ENV) -> str | None:
    """The device token from the environment, which then holds no trace of it: not os.environ, not
    libc's environ (so no child inherits it), not /proc/PID/environ (see _scrub_initial_environ)."""
    value = os.environ.get(name)
    if value is None:
        return None
    _scrub_initial_environ(name)
    os.environ.pop(name, None)  # unsetenv as well
    return value.strip() or None


def read_token_file(path: Path, warn: Callable[[str], None]) -> str:
    """The token in `path` (surrounding whitespace dropped); a file others may read gets a warning."""
    try:
        with path.open(encoding="utf-8") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            token = handle.read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read token file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"token file {path} is not text: {exc.reason}") from exc
    if not token:
        raise ValueError(f"token file {path} is empty")
    if mode & 0o077:
        warn(f"token file {path} can be read by other users (mode {stat.S_IMODE(mode):04o}): chmod 600 {path}")
    return token


@device_app.callback(invoke_without_command=True)
def device(ctx: typer.Context,
           server: Annotated[list[str] | None, typer.Option(
               "--server", help="ws://HOST:PORT (or the config's); repeat it, or give a comma list, for a cluster's "
                                "nodes: the device moves to the next when it loses one")] = None,
           token_file: Annotated[Path | None, typer.Option(
               "--token-file", help="file holding the device token (or set TETHER_DEVICE_TOKEN, which the device "
                                    "clears; a token is never taken from the command line)")] = None,
           token: Annotated[str | None, typer.Option(
               "--token", hidden=True, help="refused: a command line shows in ps; use --token-file or "
                                            "TETHER_DEVICE_TOKEN")] = None,
           name: Annotated[str | None, typer.Option("--name", help="must match the token's device")] = None,
           config: ConfigOpt = None, policy: PolicyOpt = None, state_dir: StateOpt = None, ca_file: CaOpt = None,
           tag: Annotated[list[str] | None, typer.Option("--tag", help="a tag for device selection")] = None,
           pair: Annotated[bool, typer.Option(
               "--pair", help="no token yet: ask the server to pair, show a code for an admin to approve "
                              "('tether devices approve CODE'), and keep the token it hands over")] = False,
           tls_fingerprint: Annotated[str | None, typer.Option(
               "--tls-fingerprint", help="trust exactly the server certificate with this SHA-256 fingerprint "
                                         "(a self-signed server; see 'tether server' output)")] = None,
           log_level: Annotated[str, typer.Option(
               "--log-level", help="debug, info (connection changes and each command), warning or error")] = "info",
           log_format: Annotated[str, typer.Option(
               "--log-format", help="plain lines, or json: one object per line for log shippers")] = "plain",
           allow_root: Annotated[bool, typer.Option(
               "--allow-root", help="run as root (refused otherwise; or TETHER_ALLOW_ROOT=1): sandboxed commands "
                                    "then run as the config's device.run_as user (default tether, else nobody)")
           ] = False,
           ) -> None:
    """Connect to a server, register this machine's profile, and serve commands until stopped."""
    env_token = take_device_token_from_env()  # first: gone from the environment whatever happens next
    if ctx.invoked_subcommand:
        ctx.meta["tether.device_token_in_env"] = env_token is not None  # `install` refuses to lose it silently
        return
    if token is not None:
        _error(REFUSED_ON_COMMAND_LINE)
        raise typer.Exit(2)
    from tether.device.config import load_device_config

    servers = [url.strip() for each in server or () for url in each.split(",") if url.strip()]
    from tether.device.root import RootRefused, root_check

    try:
        cfg = load_device_config(config)
        root_warning = root_check(cfg, allow_root, "tether device")  # before a token is read or a pairing asked
        secret = _device_token(cfg, token_file, env_token)
    except (ValueError, RootRefused) as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    if root_warning:
        _warn(root_warning)
    from tether.cli.logs import configure

    try:
        configure(log_level, log_format)
    except ValueError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None

    enrolment = None
    if not secret:
        from tether.cli.commands.fleet.pairing import enrol  # httpx and the admin commands: only without a token
        from tether.protocol.names import device_name_problem

        if name and (problem := device_name_problem(name)) is not None:  # as the server checks it, before asking
            _error(f"--name: {problem}")
            raise typer.Exit(2)

        enrolment = enrol(cfg, servers[0] if servers else None, state_dir, name, ca_file, tls_fingerprint, pair)
        if name and enrolment.name and name != enrolment.name:  # the admin named it when approving
            _warn(f"paired as {enrolment.name}: --name {name} is not used (the token is {enrolment.name}'s)")
        secret, name = enrolment.token, enrolment.name or name
        tls_fingerprint = tls_fingerprint or enrolment.tls_fingerprint
    secret_files = [str(p) for p in (token_file, cfg.server.token_file) if p]
    tags = [*(enrolment.tags if enrolment else []), *(tag or [])]
    code = _device(cfg, servers, secret, name, policy, state_dir, ca_file, tags, secret_files, tls_fingerprint)
    raise typer.Exit(code)


@device_app.command("key")
def device_key_cmd(config: ConfigOpt = None, state_dir: StateOpt = None,
                   new: Annotated[bool, typer.Option(
                       "--new", help="make a new key in place of the old one (the server must then be told: "
                                     "tether token rotate --device NAME --key PUBLIC_KEY)")] = False,
                   as_json: JsonOpt = False) -> None:
    """Show this device's public key and its fingerprint (the key is made on first use; the private
    half never leaves the state directory, which the sandbox hides)."""
    from tether.device.config import load_device_config
    from tether.device.link.device_key import load_device_key, new_device_key
    from tether.device.local import device_state_dir

    try:
        cfg = load_device_config(config)
        path = cfg.server.key_path(device_state_dir(cfg, state_dir), Path(cfg.source).parent if cfg.source else None)
        key = new_device_key(path) if new else load_device_key(path)
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps({"public_key": key.public_key, "fingerprint": key.fingerprint, "path": str(path)}))
        return
    console(err=True).print(f"device key {path} (fingerprint {key.fingerprint[:16]}); its public key:",
                            soft_wrap=True, markup=False)
    typer.echo(key.public_key)


def _device_token(cfg: DeviceConfig, token_file: Path | None, env_token: str | None) -> str | None:
    """--token-file, else TETHER_DEVICE_TOKEN, else the config's server.token_file (or server.token)."""
    if token_file is not None:
        return read_token_file(token_file.expanduser(), _warn)
    if env_token:
        return env_token
    if cfg.server.token_file:
        path = Path(cfg.server.token_file).expanduser()
        if not path.is_absolute() and cfg.source:
            path = Path(cfg.source).parent / path
        return read_token_file(path, _warn)
    return cfg.server.token


def _error(message: str) -> None:
    say(f"error: {message}", err=True, soft_wrap=True)  # one line, whatever the width; never markup


def _warn(message: str) -> None:
    say(f"warning: {message}", err=True, soft_wrap=True)


def _device(cfg: DeviceConfig, servers: list[str], secret: str, name: str | None, policy: Path | None,
            state_dir: Path | None, ca_file: str | None, tags: list[str], secret_files: list[str],
            tls_fingerprint: str | None = None) -> int:
    from rich.markup import escape

    from tether.device.link.connection import DeviceConnection, RegistrationRefused
    from tether.device.link.reconnect import PIN_MISMATCH
    from tether.device.serve import ServedDevice, serve_device

    out = console(err=True)
    several = False  # a cluster's nodes: say which one

    def ready(served: ServedDevice) -> None:
        nonlocal several
        several = len(served.urls) > 1
        confined, sandbox = served.local.context.sandbox, served.sandbox
        why = sandbox.detail if not sandbox.available else "the policy turns it off (sandbox: false)"
        if confined is not None:
            out.print(f"sandbox: {confined.kind} ({sandbox.detail})", soft_wrap=True, markup=False)
        elif served.local.policy.require_sandbox:
            _warn(f"no sandbox: this device will refuse to start processes (the policy's require_sandbox; set it "
                  f"to false to run them unconfined); {why}")
        else:
            _warn(f"no sandbox: processes this device starts run unconfined; {why}")
        out.print(f"connecting to {', '.join(served.urls)} …", soft_wrap=True, markup=False)

    def announce(state: str, conn: DeviceConnection) -> None:
        if state == "registered":
            again = " (reconnected)" if conn.connections > 1 else ""
            via = f" via {escape(conn.url)}" if several else ""  # which node of a cluster
            out.print(f"[green]registered as {escape(str(conn.registered_as))}[/green]{via}{again}; serving commands",
                      soft_wrap=True)
        elif state == "disconnected":
            out.print(f"[yellow]disconnected[/yellow]{': ' + escape(str(conn.last_error)) if conn.last_error else ''}; "
                      "reconnecting")

    try:
        serve_device(servers or None, token=secret, config=cfg, name=name, policy_path=policy, state_dir=state_dir,
                     ca_file=ca_file, tls_fingerprint=tls_fingerprint, tags=tags, secret_files=secret_files,
                     on_state=announce, on_ready=ready)
    except ValueError as exc:
        _error(str(exc))
        return 2
    except RegistrationRefused as exc:
        if exc.code == PIN_MISMATCH:
            out.print(f"[red]not connecting:[/red] {escape(exc.error)}", soft_wrap=True)
        else:
            out.print(f"[red]refused by the server:[/red] {escape(str(exc))}", soft_wrap=True)
        return 3
    out.print("device stopped")
    return 0


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


def _print_cert_fingerprint(cert: Path) -> None:
    """The certificate's SHA-256, for devices that pin it (--tls-fingerprint) or trust it on first use."""
    import ssl

    from tether.device.link.tls_pin import cert_fingerprint

    try:
        der = ssl.PEM_cert_to_DER_cert(cert.read_text(encoding="ascii"))
    except (OSError, ValueError) as exc:
        fail(f"cannot read the TLS certificate {cert}: {exc}")
    console(err=True).print(f"TLS certificate SHA-256 fingerprint: {cert_fingerprint(der)}", soft_wrap=True)
