"""A tiny built-in-style ToolSet exported over stdio with `serve_stdio(toolset_to_mcp(...))`."""

from __future__ import annotations

import anyio
from pydantic import BaseModel

from tether.tools.context import ToolContext
from tether.tools.errors import ToolError
from tether.tools.policy.model import Policy
from tether.tools.runtime import ToolSet, tool
from tether.tools.toolsets.mcp_export import serve_stdio, toolset_to_mcp


class Product(BaseModel):
    product: int


@tool(tool_type="data_collection")
async def multiply(a: int, b: int) -> Product:
    """Multiply two integers."""
    return Product(product=a * b)


@tool(tool_type="action")
async def refuse(reason: str) -> str:
    """Always fail with the given reason."""
    raise ToolError(reason, {"refused": True})


TOOLSET = ToolSet("math", [multiply, refuse], "arithmetic for tests")

if __name__ == "__main__":
    anyio.run(serve_stdio, toolset_to_mcp(TOOLSET, lambda: ToolContext(policy=Policy())))
