"""An MCP server whose tools carry every kind of MCP annotation, for the device's tool policy tests.

Its tools also touch real files, so a test can see what a call did (and, run sandboxed, what the
sandbox kept it from doing): a refused call must leave the file untouched.
"""

from __future__ import annotations

import os
from pathlib import Path

import mcp_types
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

mcp = MCPServer("annotated")

READ_ONLY = mcp_types.ToolAnnotations(read_only_hint=True)
DESTRUCTIVE = mcp_types.ToolAnnotations(read_only_hint=False, destructive_hint=True)
ADDITIVE = mcp_types.ToolAnnotations(read_only_hint=False, destructive_hint=False)


@mcp.tool(annotations=READ_ONLY)
def read_text(path: str) -> str:
    """Read a text file (read-only)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ToolError(f"cannot read {path}: {exc.strerror}") from None


@mcp.tool(annotations=DESTRUCTIVE)
def write_text(path: str, text: str) -> str:
    """Write (overwrite) a text file: destructive."""
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ToolError(f"cannot write {path}: {exc.strerror}") from None
    return f"wrote {len(text)} characters"


@mcp.tool(annotations=DESTRUCTIVE)
def delete(path: str) -> str:
    """Delete a file: destructive."""
    os.unlink(path)
    return "deleted"


@mcp.tool(annotations=ADDITIVE)
def append(path: str, text: str) -> str:
    """Append to a file: writes, but declares it destroys nothing."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
    return "appended"


@mcp.tool()
def plain(text: str) -> str:
    """No annotations at all: MCP's defaults (may be destructive) apply only in strict mode."""
    return text.upper()


@mcp.tool(annotations=mcp_types.ToolAnnotations(read_only_hint=True, destructive_hint=True))
def contradictory() -> str:
    """Read-only and 'destructive': destructiveHint means nothing when readOnlyHint is true (MCP spec)."""
    return "read only"


@mcp.tool(annotations=READ_ONLY)
def whoami() -> dict[str, object]:
    """What the process sees of itself: its pid (1-ish inside a pid namespace) and visible processes."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return {"pid": os.getpid(), "processes": len(pids)}


if __name__ == "__main__":
    mcp.run()
