"""`tether mcp config`: the snippet that plugs this server's MCP gateway (`/mcp`) into an MCP client.

It creates an API token for the client through the REST API (with the admin token the CLI holds) and
prints the client's configuration on stdout, ready to be saved as the client's file. Wherever the client can
read the token from an environment variable or ask for it, the configuration names the variable (or the
prompt) and not the token, and the line that sets it (`export TETHER_MCP_TOKEN='…'`, or the token to paste
when asked) goes to stderr: a project file such as `.mcp.json` or `.vscode/mcp.json` can be committed
without the secret. `--inline-token` writes the token into the configuration instead, for a client that
cannot expand variables. The new token is never put on a command line this builds, never into a log.

The client formats, as each client documents them (checked November 2026):
- Claude Desktop's claude_desktop_config.json takes stdio servers only, so the entry starts the `mcp-remote`
  bridge (npm) with the URL; the header comes from an `env` entry of that user file (Claude Desktop expands
  no variables), not from the bridge's command line.
- Claude Code (.mcp.json): `mcpServers` with `type: "http"`, `url`, `headers`; `${VAR}` is expanded in
  `headers`, so the header is `Bearer ${TETHER_MCP_TOKEN}`.
- Cursor (~/.cursor/mcp.json or .cursor/mcp.json): `mcpServers` with `url` and `headers`; `${env:VAR}` is
  expanded there.
- VS Code (.vscode/mcp.json): top-level `servers` (not `mcpServers`), `type: "http"`, `url`, `headers`; the
  token is an `inputs` entry (`promptString`, `password: true`) that VS Code asks for once and keeps in its
  secret storage, used as `${input:ID}`.
- Codex (~/.codex/config.toml or .codex/config.toml): `[mcp_servers.NAME]` with `url` and
  `bearer_token_env_var` (Codex refuses an inline `bearer_token`; inline, the header goes in `http_headers`).
  NAME is a TOML key: quoted unless it is bare (`[mcp_servers."my.fleet"]`).
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
# the environment variable the configuration names, unless --token-env (a variable's name, not a secret)
TOKEN_ENV = "TETHER_MCP_TOKEN"  # noqa: S105
INPUT_ID = "tether-token"  # VS Code's input prompting for the token
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
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
               token_env: Annotated[str, typer.Option(
                   "--token-env", metavar="VAR", help="the environment variable the client reads the token from "
                                                      "(Claude Code, Cursor, Codex)")] = TOKEN_ENV,
               inline_token: Annotated[bool, typer.Option(
                   "--inline-token", help="write the token into the configuration itself, for a client that "
                                          "cannot read it from the environment or ask for it")] = False,
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
    if not _ENV_NAME.match(token_env):
        fail(f"--token-env: {token_env[:80]!r} is not an environment variable name (letters, digits, '_')")
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
    typer.echo(snippet(client, name, url, secret, env=token_env, inline=inline_token))
    reach = f", reaching devices {', '.join(devices)}" if devices else ""
    reach += f"{', reaching' if not devices else ' and'} tags {', '.join(tag)}" if tag else ""
    err = console(err=True)
    err.print(f"API token '{label}' created for it (an agent's: scopes {', '.join(scopes)}{reach}; it never "
              "approves: a person approves in the dashboard or with 'tether approve TASK'); put the above into "
              f"{_WHERE[client]}. 'tether token revoke {label}' unplugs it.", markup=False)
    how = secret_instructions(client, secret, env=token_env, inline=inline_token)
    if how:
        err.print(how, markup=False, soft_wrap=True)


def uses_env(client: str, inline: bool) -> bool:
    """Whether the configuration of `client` names an environment variable instead of holding the token."""
    return not inline and client in ("claude-code", "cursor", "codex")


def secret_instructions(client: str, secret: str, *, env: str, inline: bool) -> str | None:
    """What the user does with the token when the configuration does not hold it: the `export` line for a
    client reading it from the environment, the token to paste for VS Code's prompt; None when it is inline."""
    if uses_env(client, inline):
        return (f"The configuration reads the token from ${env}; set it where the client starts (a shell profile, "
                f"not the project):\nexport {env}='{secret}'")
    if client == "vscode" and not inline:
        return f"VS Code asks for the token once ('{INPUT_ID}') and keeps it in its secret storage; paste:\n{secret}"
    return None


def toml_key(name: str) -> str:
    """`name` as a TOML key: bare when it may be, else a quoted basic string (a JSON string is one)."""
    return name if _BARE_KEY.match(name) else json.dumps(name)


def snippet(client: str, name: str, url: str, secret: str, *, env: str = TOKEN_ENV, inline: bool = False) -> str:
    """The configuration text of `client` for the gateway at `url`, the server named `name`: the token
    `secret` itself only with `inline` (and for Claude Desktop, which expands nothing); otherwise a reference
    to the environment variable `env` (Claude Code, Cursor, Codex) or to VS Code's input prompt."""
    entry: dict[str, Any]
    if client == "codex":
        head = f"[mcp_servers.{toml_key(name)}]\nurl = {json.dumps(url)}\n"
        if inline:
            return head + f"http_headers = {{ Authorization = {json.dumps('Bearer ' + secret)} }}"
        return head + f"bearer_token_env_var = {json.dumps(env)}"
    if client == "claude":  # stdio only: the mcp-remote bridge, the header from its environment
        entry = {"command": "npx", "args": ["-y", "mcp-remote", url, "--header", "Authorization:${TETHER_AUTH}"],
                 "env": {"TETHER_AUTH": f"Bearer {secret}"}}
        if url.startswith("http://"):
            entry["args"].insert(3, "--allow-http")
        return json.dumps({"mcpServers": {name: entry}}, indent=2)
    if inline:
        header = f"Bearer {secret}"
    else:
        header = {"claude-code": f"Bearer ${{{env}}}", "cursor": f"Bearer ${{env:{env}}}",
                  "vscode": f"Bearer ${{input:{INPUT_ID}}}"}[client]
    entry = {"url": url, "headers": {"Authorization": header}}
    if client in ("claude-code", "vscode"):
        entry = {"type": "http", **entry}
    if client != "vscode":
        return json.dumps({"mcpServers": {name: entry}}, indent=2)
    config: dict[str, Any] = {"servers": {name: entry}}
    if not inline:
        config = {"inputs": [{"type": "promptString", "id": INPUT_ID, "password": True,
                              "description": f"API token of the tether server at {url}"}], **config}
    return json.dumps(config, indent=2)
