"""An MCP server (stdio, the official SDK) whose tools ask the person two kinds of question through
elicitation: `drop_record` asks for consent (a yes/no confirmation, an approval), `pick_colour` asks for
information (a form with a text field), `choose_fate` asks to choose between two things, neither a yes. The
question-owner tests tell them apart the way the server does
(`tether.server.aip.questions.asked.asks_consent`)."""

from typing import Annotated, Literal

from mcp.server.elicitation import AcceptedElicitation, ElicitationResult
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.resolve import Elicit, Resolve
from pydantic import BaseModel

mcp = MCPServer("consenting")


class Confirm(BaseModel):
    confirm: bool


class Colour(BaseModel):
    colour: str


def _ask_consent(name: str) -> Elicit[Confirm]:
    return Elicit(f"Drop record {name}?", Confirm)


def _ask_colour(question: str) -> Elicit[Colour]:
    return Elicit(question, Colour)


@mcp.tool()
async def drop_record(name: str, answer: Annotated[ElicitationResult[Confirm], Resolve(_ask_consent)]) -> str:
    """Pretend to drop a record, once the person confirms (nothing is dropped: the answer is reported)."""
    if isinstance(answer, AcceptedElicitation):
        return f"dropped {name}" if answer.data.confirm else f"kept {name}"
    return answer.action


@mcp.tool()
async def pick_colour(question: str, answer: Annotated[ElicitationResult[Colour], Resolve(_ask_colour)]) -> str:
    """Ask the person for a colour and say what came back."""
    if isinstance(answer, AcceptedElicitation):
        return f"accept: {answer.data.colour}"
    return answer.action


class Fate(BaseModel):
    fate: Literal["wipe the backups", "keep them"]


def _ask_fate(question: str) -> Elicit[Fate]:
    return Elicit(question, Fate)


@mcp.tool()
async def choose_fate(question: str, answer: Annotated[ElicitationResult[Fate], Resolve(_ask_fate)]) -> str:
    """Ask the person to choose between two things, neither a yes, the worse first; say what came back."""
    if isinstance(answer, AcceptedElicitation):
        return f"chose: {answer.data.fate}"
    return answer.action


if __name__ == "__main__":
    mcp.run("stdio")
