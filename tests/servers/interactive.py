"""An MCP server that uses the client's capabilities, for the device-as-MCP-client tests (stdio).

Each tool exercises one of them: progress notifications, an elicitation, a sampling request, the
client's roots, and log messages at several levels.
"""

from typing import Annotated

import mcp_types
from mcp.server.elicitation import AcceptedElicitation, ElicitationResult
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.resolve import Elicit, ListRoots, Resolve, Sample
from pydantic import BaseModel

mcp = MCPServer("interactive")


@mcp.tool()
async def count(steps: int, ctx: Context) -> str:
    """Report progress once per step, each with a message."""
    for i in range(1, steps + 1):
        await ctx.report_progress(i, steps, f"step {i} of {steps}")
    return f"counted {steps}"


class Choice(BaseModel):
    colour: str


# Resolvers ask through the client's capabilities on either protocol: a request mid-call (2025-11-25)
# or an InputRequiredResult the client answers and retries with (2026-07-28).
def _ask_colour(question: str) -> Elicit[Choice]:
    return Elicit(question, Choice)


def _ask_llm(prompt: str) -> Sample:
    return Sample([mcp_types.SamplingMessage(role="user", content=mcp_types.TextContent(type="text", text=prompt))],
                  max_tokens=50)


def _list_roots() -> ListRoots:
    return ListRoots()


@mcp.tool()
async def ask(question: str, answer: Annotated[ElicitationResult[Choice], Resolve(_ask_colour)]) -> str:
    """Ask the person a question through elicitation and say what came back."""
    if isinstance(answer, AcceptedElicitation):
        return f"accept: {answer.data.colour}"
    return answer.action


@mcp.tool()
async def sample(prompt: str, result: Annotated[mcp_types.CreateMessageResult, Resolve(_ask_llm)]) -> str:
    """Ask the client's LLM."""
    text = result.content.text if isinstance(result.content, mcp_types.TextContent) else str(result.content)
    return f"{result.model}: {text}"


@mcp.tool()
async def roots(listed: Annotated[mcp_types.ListRootsResult, Resolve(_list_roots)]) -> list[str]:
    """The client's roots, as URIs."""
    return [str(root.uri) for root in listed.roots]


@mcp.tool()
async def chatter(ctx: Context) -> str:
    """Log at three levels, then answer."""
    await ctx.debug("debug line from interactive")
    await ctx.info("info line from interactive")
    await ctx.warning("warning line from interactive")
    return "logged"


if __name__ == "__main__":
    mcp.run("stdio")
