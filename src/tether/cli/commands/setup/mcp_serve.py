"""`tether mcp serve --stdio`: this machine's tools, built-in and external, as one MCP server for one MCP client
(an IDE, a desktop assistant), with no agent server; the successor of `tether tools serve NAME`, which serves
one built-in set and stays."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tether.cli.common import ConfigOpt, PolicyOpt, StateOpt, fail, mcp_app, run_async

if TYPE_CHECKING:
    from tether.device.config import DeviceConfig


@mcp_app.command("serve")
def mcp_serve(stdio: Annotated[bool, typer.Option(
                  "--stdio", help="speak MCP on stdin/stdout (the only transport for now; an MCP client starts "
                                  "this command)")] = False,
              config: ConfigOpt = None, policy: PolicyOpt = None, state_dir: StateOpt = None,
              session: Annotated[str | None, typer.Option("--session", help="session id of the calls (for "
                                                                            "'tether undo')")] = None) -> None:
    """Serve all of this machine's tools (built-in and external) to one MCP client.

    The same policy, sandbox and approvals as 'tether exec'; a call that needs approval is a tool error that
    says how a person runs it."""
    if not stdio:
        fail("say how to serve: --stdio (an MCP client starts 'tether mcp serve --stdio' and talks on its pipes)")
    from tether.cli.basics import load_config
    from tether.cli.guards.state_lock import device_state, holding_state_dir

    cfg = load_config(config)  # read once: the state directory and the device
    with holding_state_dir(device_state(cfg, state_dir), "tether mcp serve"):  # one process per state directory
        run_async(_serve(cfg, policy, state_dir, session or f"mcp-{uuid.uuid4().hex[:12]}"))


async def _serve(config: DeviceConfig, policy: Path | None, state_dir: Path | None, session_id: str) -> None:
    from tether.device.local import open_local_device
    from tether.device.mcp.device_server import serve_device_stdio

    async with open_local_device(config, policy_path=policy, state_dir=state_dir,
                                 lock_state_dir=False) as device:  # mcp_serve holds it
        await serve_device_stdio(device, session_id)
