"""Sizes and error words of external MCP servers' sessions (apart from `mcp.servers`, which was past
400 lines): how large a message a server may send, how large a tool result is, and the one-line
message of a failure anyio wrapped in exception groups."""

from __future__ import annotations

import mcp_types
from mcp.shared.exceptions import MCPError
from pydantic_core import to_json


def message_limit(max_result_bytes: int) -> int:
    """The largest MCP message a server may send: a result can come twice in one (as text and as
    structured content, as the SDK's servers send a returned value), plus the envelope."""
    return 2 * max_result_bytes + 64 * 1024


def result_size(result: mcp_types.CallToolResult, limit: int) -> int:
    """About how many bytes of a tool result reach the caller (its content's text and data, or its
    structured content, whichever is larger); counting stops past `limit`."""
    size = 0
    for block in result.content:
        if type(block) is mcp_types.TextContent:  # the common block: only its text counts
            size += len(block.text)
            if size > limit:
                return size
            continue
        # the fields a block has, read from its __dict__: a pydantic model's getattr of a field it lacks
        # raises and catches an AttributeError, several times the cost of the rest of this loop
        fields = _fields(block)
        for attr in ("text", "data"):
            value = fields.get(attr)
            if isinstance(value, str):
                size += len(value)
        resource = fields.get("resource")
        if resource is not None:
            inner = _fields(resource)
            for attr in ("text", "blob"):
                value = inner.get(attr)
                if isinstance(value, str):
                    size += len(value)
        if size > limit:
            return size
    if result.structured_content:
        size = max(size, len(to_json(result.structured_content)))
    return size


def _fields(model: object) -> dict[str, object]:
    fields = getattr(model, "__dict__", None)
    return fields if isinstance(fields, dict) else {}


def innermost_error(exc: BaseException | None) -> BaseException | None:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def describe_error(exc: BaseException | None) -> str:
    """The innermost message: anyio wraps transport failures in (nested) ExceptionGroups."""
    leaf = innermost_error(exc)
    if leaf is None:
        return "unknown error"
    if isinstance(leaf, MCPError):
        return f"{leaf.message} (MCP error {leaf.code})"
    text = str(leaf)
    return f"{type(leaf).__name__}: {text}" if text else type(leaf).__name__
