"""`tether mcp config` as a user runs it (the real CLI process) against a real agent server: each client's
snippet is parsed the way that client reads it, and the official `mcp` SDK client connects with what it says."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tests.kits.netutil import free_port
from tests.kits.task import WAIT, AgentServer
from tether.tools.policy.model import default_policy

CLI = [sys.executable, "-m", "tether.cli"]


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[AgentServer]:
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", default_policy(), tmp_path / "state-alpha")
        await server.add_device("beta", default_policy(), tmp_path / "state-beta")
        yield server


async def tether(*args: str, server: str, token: str) -> tuple[int, str, str]:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "TETHER_SERVER": server, "TETHER_TOKEN": token}
    proc = await asyncio.create_subprocess_exec(*CLI, "mcp", "config", *args, env=env,
                                                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def base(agent: AgentServer) -> str:
    return f"http://127.0.0.1:{agent.port}"


def admin(agent: AgentServer) -> str:
    return agent.store.tokens.create("api", "root", ["admin"])[1]


def endpoint(client: str, text: str, err: str = "", name: str = "tether") -> tuple[str, str]:
    """(url, Authorization header) as the client would read them from its configuration (`text`, parsed with
    the real parser), resolving its variable from what the user was told to set (`err`)."""
    if client == "codex":
        entry = tomllib.loads(text)["mcp_servers"][name]
        if "http_headers" in entry:
            return entry["url"], entry["http_headers"]["Authorization"]
        [secret] = re.findall(rf"export {entry['bearer_token_env_var']}='([^']+)'", err)
        return entry["url"], f"Bearer {secret}"
    config = json.loads(text)
    entry = config["servers" if client == "vscode" else "mcpServers"][name]
    if client == "claude":
        assert entry["command"] == "npx" and entry["args"][:2] == ["-y", "mcp-remote"]
        assert "--allow-http" in entry["args"] and "Authorization:${TETHER_AUTH}" in entry["args"]
        assert not any("Bearer" in a for a in entry["args"])  # the token is not on the bridge's command line
        return entry["args"][2], entry["env"]["TETHER_AUTH"]
    assert entry.get("type") == ("http" if client in ("vscode", "claude-code") else None)
    header = entry["headers"]["Authorization"]
    variable = re.search(r"\$\{(?:env:|input:)?([A-Za-z0-9_-]+)\}", header)
    if variable is None:
        return entry["url"], header
    if client == "vscode":  # an input VS Code prompts for: the token the user was told to paste
        [asked] = config["inputs"]
        assert asked["id"] == variable.group(1) and asked["type"] == "promptString" and asked["password"] is True
        secret = err.strip().splitlines()[-1]
    else:
        [secret] = re.findall(rf"export {variable.group(1)}='([^']+)'", err)
    return entry["url"], header.replace(variable.group(0), secret)


async def tools_seen(url: str, header: str) -> set[str]:
    async with httpx2.AsyncClient(headers={"Authorization": header}, timeout=WAIT) as http, \
            streamable_http_client(url, http_client=http) as (read, write), \
            ClientSession(read, write, read_timeout_seconds=WAIT) as client:
        await client.initialize()
        return {t.name for t in (await client.list_tools()).tools}


@pytest.mark.parametrize("client", ["claude", "claude-code", "cursor", "vscode", "codex"])
async def test_each_clients_snippet_connects_with_a_new_token(agent: AgentServer, client: str) -> None:
    code, out, err = await tether("--client", client, server=base(agent), token=admin(agent))
    assert code == 0, err
    url, header = endpoint(client, out, err)
    assert url == f"{base(agent)}/mcp"
    secret = header.removeprefix("Bearer ")
    if client == "claude":  # Claude Desktop expands no variables: the token sits in its (user) config file
        assert secret in out and secret not in err
    else:  # a project file without the secret: the client reads it from the environment or asks for it
        assert secret not in out and err.count(secret) == 1
    tools = await tools_seen(url, header)
    assert {"run_task", "list_devices", "alpha__shell.run", "beta__shell.run"} <= tools
    made = [t for t in agent.store.tokens.all() if t.name == f"mcp-{client}"]
    # an agent's token (issue 27): it runs and reads, and never approves
    assert len(made) == 1 and sorted(made[0].scopes) == ["execute", "read"] and made[0].agent
    assert not made[0].allows("approve") and "never approves" in err
    assert f"mcp-{client}" in err


async def test_device_filter_name_and_scope(agent: AgentServer) -> None:
    code, out, err = await tether("--client", "cursor", "--device", "alpha", "--token-name", "ide-1", "--scope",
                                  "read", server=base(agent), token=admin(agent))
    assert code == 0, err
    url, header = endpoint("cursor", out, err)
    assert url == f"{base(agent)}/mcp?devices=alpha"
    tools = await tools_seen(url, header)
    assert "alpha__shell.run" in tools and not any(t.startswith("beta__") for t in tools) and "run_task" in tools
    [made] = [t for t in agent.store.tokens.all() if t.name == "ide-1"]
    assert made.scopes == ["read"]


async def test_refusals_are_one_line_and_create_nothing(agent: AgentServer) -> None:
    runner = agent.store.tokens.create("api", "runner", ["read", "execute"])[1]
    root = admin(agent)
    before = len(agent.store.tokens.all())
    results = {
        "not admin": await tether(server=base(agent), token=runner),
        "bad token": await tether(server=base(agent), token="nope"),
        "bad client": await tether("--client", "emacs", server=base(agent), token=root),
        "bad scope": await tether("--scope", "root", server=base(agent), token=root),
        "a person's scope": await tether("--scope", "approve", server=base(agent), token=root),
        "bad device": await tether("--device", "a b", server=base(agent), token=root),
        "unreachable": await tether(server=f"http://127.0.0.1:{free_port()}", token="x"),
    }
    codes = {what: code for what, (code, _, _) in results.items()}
    assert codes == {"not admin": 1, "bad token": 2, "bad client": 2, "bad scope": 2, "a person's scope": 2,
                     "bad device": 2, "unreachable": 4}
    for what, (_, out, err) in results.items():
        assert out == "" and err.startswith("error: ") and "Traceback" not in err, (what, err)
    assert "admin" in results["not admin"][2] and "emacs" in results["bad client"][2]
    assert "never approves" in results["a person's scope"][2]
    assert len(agent.store.tokens.all()) == before



@pytest.mark.parametrize("client", ["claude", "claude-code", "cursor", "vscode", "codex"])
@pytest.mark.parametrize("name", ["my.fleet", "a@b", "lab-1"])
async def test_server_names_are_valid_in_each_format(agent: AgentServer, client: str, name: str) -> None:
    code, out, err = await tether("--client", client, "--name", name, "--token-name", f"n-{client}-{name}",
                                  "--token-env", "FLEET_TOKEN", server=base(agent), token=admin(agent))
    assert code == 0, err
    if client == "codex":
        servers = tomllib.loads(out)["mcp_servers"]
        assert list(servers) == [name], out  # one server of that name, not a table nested under 'my'
        assert servers[name]["bearer_token_env_var"] == "FLEET_TOKEN"
    else:
        assert list(json.loads(out)["servers" if client == "vscode" else "mcpServers"]) == [name]
    if client in ("claude-code", "cursor", "codex"):
        assert "export FLEET_TOKEN='" in err and "FLEET_TOKEN" in out
    url, header = endpoint(client, out, err, name)
    assert url == f"{base(agent)}/mcp" and header.startswith("Bearer ") and "$" not in header


@pytest.mark.parametrize("client", ["claude-code", "cursor", "vscode", "codex"])
async def test_inline_token_is_written_into_the_configuration(agent: AgentServer, client: str) -> None:
    code, out, err = await tether("--client", client, "--inline-token", "--token-name", f"inline-{client}",
                                  server=base(agent), token=admin(agent))
    assert code == 0, err
    url, header = endpoint(client, out)  # nothing to resolve: the header is in the file
    secret = header.removeprefix("Bearer ")
    assert secret in out and secret not in err and "${" not in out and "inputs" not in out
    if client == "codex":
        assert "bearer_token_env_var" not in tomllib.loads(out)["mcp_servers"]["tether"]
    assert {"run_task", "list_devices"} <= await tools_seen(url, header)


async def test_a_bad_token_env_is_refused(agent: AgentServer) -> None:
    root = admin(agent)
    before = len(agent.store.tokens.all())
    code, out, err = await tether("--client", "codex", "--token-env", "NOT-A-VAR", server=base(agent), token=root)
    assert code == 2 and out == "" and err.startswith("error: --token-env")
    assert len(agent.store.tokens.all()) == before
