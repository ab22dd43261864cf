"""`tether device`: this machine connected to a server as a device (its options; what it does is
`device_run.run_device`), and `tether device key`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from tether.cli.commands.setup.device_run import run_device, take_device_token_from_env
from tether.cli.common import CaOpt, ConfigOpt, JsonOpt, PolicyOpt, StateOpt, console, device_app, fail


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
    raise typer.Exit(run_device(env_token, server=server, token_file=token_file, token=token, name=name,
                                config=config, policy=policy, state_dir=state_dir, ca_file=ca_file, tag=tag,
                                pair=pair, tls_fingerprint=tls_fingerprint, log_level=log_level,
                                log_format=log_format, allow_root=allow_root))


@device_app.command("key")
def device_key_cmd(config: ConfigOpt = None, state_dir: StateOpt = None,
                   new: Annotated[bool, typer.Option(
                       "--new", help="make a new key in place of the old one (the server must then be told: "
                                     "tether token rotate --device NAME --key PUBLIC_KEY)")] = False,
                   as_json: JsonOpt = False) -> None:
    """Show this device's public key and its fingerprint (the key is made on first use; the private
    half never leaves the state directory, which the sandbox hides)."""
    from tether.device.config import load_device_config
    from tether.device.link.trust.device_key import load_device_key, new_device_key
    from tether.device.local import device_state_dir

    try:
        cfg = load_device_config(config)
        path = cfg.server.key_path(device_state_dir(cfg, state_dir), Path(cfg.source).parent if cfg.source else None)
        if not path.parent.parent.is_dir():  # a mistyped path mints no key somewhere unexpected
            fail(f"the state directory {path.parent} cannot be made: {path.parent.parent} does not exist; no key "
                 "was made (a mistyped --state-dir?)")
        made = [str(p) for p in (path.parent, path) if not p.exists() or (p == path and new)]
        key = new_device_key(path) if new else load_device_key(path)
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps({"public_key": key.public_key, "fingerprint": key.fingerprint, "path": str(path),
                               "made": made}))
        return
    for each in made:  # a new state directory, a new key: said, so a typo's is seen
        console(err=True).print(f"made {each}", soft_wrap=True, markup=False)
    console(err=True).print(f"device key {path} (fingerprint {key.fingerprint[:16]}); its public key:",
                            soft_wrap=True, markup=False)
    typer.echo(key.public_key)
