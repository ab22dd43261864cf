"""Whether a host names this machine alone: the one loopback check of the server's bind and the OIDC issuer's
URLs (`tether.server`) and of the tools' own MCP endpoint (`tether.tools.toolsets.mcp_export`). Standard library only,
importing nothing of tether, so any layer may use it.
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True only for addresses that cannot be reached from another machine: `localhost` (any case) and the
    loopback addresses (127.0.0.0/8, ::1; an IPv6 address may be in brackets, surrounding blanks are dropped).

    `0.0.0.0`, `::` and any name other than `localhost` count as exposed: a name may resolve to
    anything, and the safe answer for "is this reachable from outside?" is yes.
    """
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
