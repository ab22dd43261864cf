"""Built-in tool sets exported as real MCP servers (`tether tools serve NAME`), so any MCP client
can use them with the same validation, policy and timeouts the device applies; and the translation
between tether `Result`s and MCP tool results, both ways (the device reads external servers' results
with `call_result_to_result`).

The low-level `mcp.server.Server` is used rather than `MCPServer`: it publishes each tool's
`ToolSpec.input_schema` exactly as written (MCPServer would derive a second schema from the
function signature) and leaves argument validation to `ToolSet.call`, whose errors name the
argument. A failed call is an `is_error` result, never a protocol error.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from collections.abc import Callable
from typing import Any

import mcp_types
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.server.stdio import stdio_server
from pydantic_core import to_jsonable_python

from tether.addresses import is_loopback
from tether.protocol.models import Result, ResultStatus
from tether.tools.context import ToolContext
from tether.tools.runtime import ToolSet
from tether.version import __version__

__all__ = [
    "call_result_to_result", "content_payload", "is_result_wrapper", "result_shape_schema", "result_to_call_result",
    "serve_http", "serve_stdio", "toolset_to_mcp",
]


def toolset_to_mcp(toolset: ToolSet, ctx_factory: Callable[[], ToolContext], *,
                   name: str | None = None) -> Server[Any]:
    """An MCP server whose tools are `toolset`'s; `ctx_factory` gives each call its policy and journal."""
    tools = [mcp_types.Tool(name=spec.name, description=spec.description or None,
                            input_schema=spec.input_schema, output_schema=spec.output_schema)
             for spec in toolset.specs.values()]
    listing = mcp_types.ListToolsResult(tools=tools)

    async def on_list_tools(ctx: ServerRequestContext[Any],
                            params: mcp_types.PaginatedRequestParams | None) -> mcp_types.ListToolsResult:
        return listing

    async def on_call_tool(ctx: ServerRequestContext[Any],
                           params: mcp_types.CallToolRequestParams) -> mcp_types.CallToolResult:
        tool_ctx = ctx_factory()
        if tool_ctx.call_id is None and ctx.request_id is not None:  # lets audit and journal name the call
            tool_ctx = dataclasses.replace(tool_ctx, call_id=str(ctx.request_id))
        result = await toolset.call(params.name, params.arguments, tool_ctx)
        return result_to_call_result(result)

    return Server(name or f"tether-{toolset.namespace}", version=__version__,
                  description=toolset.description or None, on_list_tools=on_list_tools,
                  on_call_tool=on_call_tool)


def result_to_call_result(result: Result) -> mcp_types.CallToolResult:
    """Dicts travel as structured content (and as JSON text for clients that read only text);
    a string is sent as plain text so a person or model reads it unquoted."""
    payload = to_jsonable_python(result.result, fallback=str)
    structured = payload if isinstance(payload, dict) else None
    if not result.ok:
        text = result.error or f"failed ({result.status.value})"
        return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text=text)],
                                        structured_content=structured, is_error=True)
    content: list[mcp_types.ContentBlock]
    if _is_image(payload):
        content = [mcp_types.ImageContent(type="image", data=payload["data"], mime_type=payload["mimeType"])]
    elif isinstance(payload, str):
        content = [mcp_types.TextContent(type="text", text=payload)]
    elif payload is None:
        content = []
    else:
        content = [mcp_types.TextContent(type="text", text=json.dumps(payload, ensure_ascii=False))]
    return mcp_types.CallToolResult(content=content, structured_content=structured)


def _is_image(payload: Any) -> bool:
    return (isinstance(payload, dict) and payload.get("type") == "image"
            and isinstance(payload.get("data"), str) and isinstance(payload.get("mimeType"), str))


async def serve_stdio(server: Server[Any] | MCPServer) -> None:
    """Serve on stdin/stdout until the client closes stdin."""
    if isinstance(server, MCPServer):
        await server.run_stdio_async()
        return
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


async def serve_http(server: Server[Any] | MCPServer, host: str = "127.0.0.1", port: int = 8765, *,
                     path: str = "/mcp", allow_remote: bool = False, log_level: str = "warning",
                     sock: socket.socket | None = None) -> None:
    """Serve streamable HTTP with uvicorn until cancelled; on `sock` when given, a socket already bound and
    listening (socket activation, or a parent that connects before this server has started: connections
    wait in its backlog), else on `host`:`port`.

    There is no authentication on this endpoint and the tools act on this machine, so binding
    anything but loopback needs `allow_remote=True` (put an authenticating proxy in front).
    """
    if sock is not None:
        host = sock.getsockname()[0]
    if not allow_remote and not is_loopback(host):
        raise ValueError(f"refusing to serve tools on {host}: not a loopback address and this endpoint has "
                         "no authentication (pass allow_remote=True behind an authenticating proxy)")
    import uvicorn  # the SDK's dependency; imported here so stdio serving never pays for it

    app = server.streamable_http_app(streamable_http_path=path, host=host)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on")
    await uvicorn.Server(config).serve(sockets=[sock] if sock is not None else None)


def is_result_wrapper(schema: dict[str, Any] | None) -> bool:
    """The Python SDK sends a non-object return value `x` as `{"result": x}` (structured content
    must be an object) and says so with this output schema; the tool's value is `x`."""
    return (schema is not None and schema.get("type") == "object" and schema.get("required") == ["result"]
            and list(schema.get("properties", {})) == ["result"])


def call_result_to_result(res: mcp_types.CallToolResult, *, server: str, tool: str,
                          call_id: str | None, unwrap: bool = False) -> Result:
    """`is_error` is a failure carrying the text; otherwise one shape whatever the number of content
    items (`result_shape`), so a plan's `$ref` and a person's screen never depend on how many a
    server happened to send."""
    if res.is_error:
        text = "; ".join(b.text for b in res.content if isinstance(b, mcp_types.TextContent))
        return Result(status=ResultStatus.FAILURE, namespace=server, call_id=call_id,
                      error=f"server '{server}' tool '{tool}': {text or 'the tool reported an error'}",
                      result=res.structured_content)
    structured = res.structured_content
    if unwrap and isinstance(structured, dict) and structured.keys() == {"result"}:
        structured = structured["result"]
    return Result(status=ResultStatus.SUCCESS, result=content_payload(res.content, structured, server),
                  namespace=server, call_id=call_id)


def content_payload(blocks: list[Any], structured: Any = None, server: str | None = None) -> dict[str, Any]:
    """`{text, content, structured}`: `text` the text items joined by newlines (a structured result's
    text twin stays there), `content` every item as MCP content dicts (images, audio and blobs base64
    with their mimeType; a `resource_link` or embedded resource names its `server`, for
    `mcp.read_resource`), `structured` the structuredContent or None. Sizes are capped by the caller
    (`max_result_bytes`)."""
    texts: list[str] = []
    content: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, mcp_types.TextContent):
            texts.append(block.text)
            if type(block) is mcp_types.TextContent and block.annotations is None and block.meta is None:
                content.append({"type": "text", "text": block.text})  # what its dump gives, without the dump
                continue
        content.append(_block(block, server))
    return {"text": "\n".join(texts), "content": content, "structured": structured}


def result_shape_schema(structured: dict[str, Any] | None, unwrap: bool = False) -> dict[str, Any]:
    """The output schema of `content_payload`'s shape around a tool's own (structured) output schema."""
    if unwrap and structured is not None and is_result_wrapper(structured):
        structured = structured["properties"]["result"]
    return {"type": "object", "required": ["text", "content", "structured"],
            "properties": {"text": {"type": "string"}, "content": {"type": "array", "items": {"type": "object"}},
                           "structured": structured if structured is not None else {}}}


def _block(block: Any, server: str | None = None) -> dict[str, Any]:
    item: dict[str, Any] = block.model_dump(mode="json", by_alias=True, exclude_none=True)
    if server is not None and isinstance(block, mcp_types.ResourceLink | mcp_types.EmbeddedResource):
        item["server"] = server
    return item
