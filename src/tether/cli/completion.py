"""Shell completion of the names a server knows: devices, a device's tools, tasks, tokens and inbox items.

Each function is a typer `autocompletion` callback: it asks the server named by the command line (or
TETHER_SERVER, TETHER_TOKEN, the saved token) with a short timeout and answers the names that start with what
was typed; on any failure (no server, no token, a timeout) it answers nothing, silently — a shell's
completion must never print an error or hang. Nothing heavy is imported until a completion runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

TIMEOUT_S = 1.0


def _ask(ctx: typer.Context | None, question: Callable[[Any], Any]) -> Any:
    params = ctx.params if ctx is not None else {}
    try:
        from tether.client.rest import RemoteServer

        with RemoteServer(params.get("server"), params.get("token"), ca_file=params.get("ca_file"),
                          timeout=TIMEOUT_S) as remote:
            return question(remote)
    except Exception:  # completion is silent: no server, no token, a refusal, a timeout
        return []


def _starting(names: list[str], incomplete: str) -> list[str]:
    return [n for n in dict.fromkeys(names) if n.startswith(incomplete)]


def devices(ctx: typer.Context, incomplete: str) -> list[str]:
    """The server's device names."""
    return _starting([str(d.get("name")) for d in _ask(ctx, lambda r: r.devices())], incomplete)


def tools(ctx: typer.Context, incomplete: str) -> list[str]:
    """The tools of the device given with --device (nothing without one)."""
    device = ctx.params.get("device")
    if not device:
        return []
    return _starting([t.name for t in _ask(ctx, lambda r: r.tools(device, timeout=TIMEOUT_S))], incomplete)


def tasks(ctx: typer.Context, incomplete: str) -> list[str]:
    """The ids (12 characters) of the server's latest tasks."""
    return _starting([str(t.get("id", ""))[:12] for t in _ask(ctx, lambda r: r.tasks(100))], incomplete)


def tokens(ctx: typer.Context, incomplete: str) -> list[str]:
    """Token ids and names (an admin token lists them)."""
    rows = _ask(ctx, lambda r: r._request("GET", "/tokens"))
    return _starting([str(t.get(k)) for t in rows if not t.get("revoked_at") for k in ("id", "name")], incomplete)


def inbox(ctx: typer.Context, incomplete: str) -> list[str]:
    """The ids of what waits for this token's answer (`tether approvals`)."""
    return _starting([str(i.get("id")) for i in _ask(ctx, lambda r: r.approvals())], incomplete)
