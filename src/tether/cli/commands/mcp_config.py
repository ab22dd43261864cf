"""`tether mcp config`: the snippet that plugs this server's MCP gateway (`/mcp`) into an MCP client.

It creates an API token for the client through the REST API (with the admin token the CLI holds) and
prints the client's configuration with it. The new token is written only into the printed snippet: never
onto a command line this builds, never into a log.

The client formats, as each client documents them (checked November 2026):
- Claude Desktop's claude_desktop_config.json takes stdio servers only, so the entry starts the `mcp-remote`
  bridge (npm) with the URL; the header comes from an `env` entry, not from the bridge's command line.
- Claude Code (.mcp.json): `mcpServers` with `type: "http"`, `url`, `headers`.
- Cursor (~/.cursor/mcp.json): `mcpServers` with `url` and `headers`.
- VS Code (.vscode/mcp.json): top-level `servers` (not `mcpServers`), `type: "http"`, `url`, `headers`.
- Codex (~/.codex/config.toml): `[mcp_servers.NAME]` with `url` and `bearer_token_env_var` (Codex refuses
  an inline `bearer_token`); the token goes in that environment variable.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any
from urllib.parse import quote

import typer

from tether.cli.common import CaOpt, ExitCode, ServerOpt, TokenOpt, console, fail, fail_remote, mcp_app

CLIENTS = ("claude", "claude-code", "cursor", "vscode", "codex")
SCOPES = ("read", "execute")  # the token is an agent's: never approve or admin (docs/security/approvals.md)
CODEX_ENV = "TETHER_MCP_TOKEN"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
_DEVICE = re.compile(r"^[A-Za-z0-9._@*?\[\]-]{1,128}$")
_WHERE = {"claude": "claude_desktop_config.json (Settings > Developer > Edit Config), in its mcpServers",
          "claude-code": ".mcp.json in the project (or ~/.claude.json), in its mcpServers",
          "cursor": "~/.cursor/mcp.json (or .cursor/mcp.json in the project), in its mcpServers",
          "vscode": ".vscode/mcp.json (or the user MCP configuration), in its servers",
          "codex": "~/.codex/config.toml"}


@mcp_app.command("config")
def mcp_config(client: Annotated[str, typer.Option("--client", metavar="|".join(CLIENTS),
                                                   help="the MCP client to configure")] = "claude",
               device: Annotated[list[str] | None, typer.Option(
                   "--device", metavar="NAME", help="the devices the client reaches (a name or glob; repeat): the "
                                                    "token made for it is scoped to them, and only their tools "
                                                    "are listed; the fleet and task tools are always listed")] = None,
               tag: Annotated[list[str] | None, typer.Option(
                   "--tag", metavar="TAG", help="the client also reaches the devices with this tag (repeat)")] = None,
               token_name: Annotated[str | None, typer.Option(
                   "--token-name", metavar="NAME", help="name of the API token created for the client "
                                                        "(default mcp-CLIENT)")] = None,
               scope: Annotated[list[str] | None, typer.Option(
                   "--scope", metavar="SCOPE", help="the new token's scopes (repeat; read, execute; default both): "
                                                    "it is an agent's token, which never approves")] = None,
               name: Annotated[str, typer.Option("--name", metavar="NAME",
                                                 help="the server's name in the client's configuration")] = "tether",
               server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None) -> None:
    """Print the configuration that plugs this server's fleet (MCP at /mcp) into an MCP client, with a new API
    token made for it (needs an admin token in TETHER_TOKEN)."""
    from tether.client.rest import RemoteError, RemoteServer

    if client not in CLIENTS:
        fail(f"--client: {client!r} is not one of {', '.join(CLIENTS)}")
    scopes = list(dict.fromkeys(scope or ["read", "execute"]))
    if people := [s for s in scopes if s in ("approve", "admin")]:
        fail(f"--scope: {', '.join(people)} is a person's: the token an MCP client holds is an agent's, and an agent "
             "never approves; a person approves in the dashboard or with 'tether approve TASK'")
    bad = [s for s in scopes if s not in SCOPES]
    if bad:
        fail(f"--scope: {', '.join(map(repr, bad))} is not a scope (read, execute)")
    label = token_name or f"mcp-{client}"
    if not _NAME.match(label):
        fail(f"--token-name: {label[:80]!r} is not a token name (letters, digits, '.', '_', '@', '-'; at most 128)")
    if not _NAME.match(name):
        fail(f"--name: {name[:80]!r} is not a server name (letters, digits, '.', '_', '@', '-')")
    devices = list(dict.fromkeys(device or []))
    for pattern in devices:
        if not _DEVICE.match(pattern):
            fail(f"--device: {pattern[:80]!r} is not a device name or glob")
    with RemoteServer(server, token, ca_file=ca_file) as remote:
        url = remote.base_url + "/mcp" + (f"?devices={quote(','.join(devices), safe=',*?@')}" if devices else "")
        try:
            # scoped to the devices named: --device limits what the client reaches, not only what it lists
            created = remote._request("POST", "/tokens", json={"kind": "api", "name": label, "scopes": scopes,
                                                               "devices": devices, "tags": list(tag or []),
                                                               "agent": True})
        except RemoteError as exc:
            fail_remote(exc, ExitCode.FAILED, hint=" (creating the client's token needs the admin scope)"
                        if exc.status == 403 else "")
    secret = created.get("token") if isinstance(created, dict) else None
    if not isinstance(secret, str) or not secret:
        fail("the server did not return the new token", ExitCode.FAILED)
    typer.echo(snippet(client, name, url, secret))
    reach = f", reaching devices {', '.join(devices)}" if devices else ""
    reach += f"{', reaching' if not devices else ' and'} tags {', '.join(tag)}" if tag else ""
    console(err=True).print(f"API token '{label}' created for it (an agent's: scopes {', '.join(scopes)}{reach}; it "
                            "never approves: a person approves in the dashboard or with 'tether approve TASK'); paste "
                            f"the above into {_WHERE[client]}. 'tether token revoke {label}' unplugs it.", markup=False)


def snippet(client: str, name: str, url: str, secret: str) -> str:
    """The client's configuration text for the gateway at `url` with bearer token `secret`."""
    header = f"Bearer {secret}"
    entry: dict[str, Any]
    if client == "codex":
        return (f"[mcp_servers.{name}]\nurl = {json.dumps(url)}\nbearer_token_env_var = \"{CODEX_ENV}\"\n\n"
                f"# Codex reads the token from its environment; before starting Codex:\n"
                f"#   export {CODEX_ENV}='{secret}'")
    if client == "claude":  # stdio only: the mcp-remote bridge, the header from its environment
        entry = {"command": "npx", "args": ["-y", "mcp-remote", url, "--header", "Authorization:${TETHER_AUTH}"],
                 "env": {"TETHER_AUTH": header}}
        if url.startswith("http://"):
            entry["args"].insert(3, "--allow-http")
        return json.dumps({"mcpServers": {name: entry}}, indent=2)
    entry = {"url": url, "headers": {"Authorization": header}}
    if client in ("claude-code", "vscode"):
        entry = {"type": "http", **entry}
    return json.dumps({"servers" if client == "vscode" else "mcpServers": {name: entry}}, indent=2)
