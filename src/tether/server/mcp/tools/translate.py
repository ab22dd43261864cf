"""The gateway's translations to the wire: tether's tools and replies as MCP types, and its HTTP refusals."""

from __future__ import annotations

import functools
import json
from typing import Any

import mcp_types as types

from tether.protocol.models import ToolInfo
from tether.server.mcp.contributed import GatewayTool
from tether.server.mcp.listing import DeviceTool, tool_annotations
from tether.server.mcp.tools.tool_call import Reply


def device_tool(tool: DeviceTool) -> types.Tool:
    """A device's tool as `/mcp` lists it: an external server's `title` and `annotations` as that server gave
    them, tether's own tools annotated from their tool type (`tool_annotations`)."""
    info = tool.info
    return types.Tool(name=tool.name, title=info.title,
                      description=f"[device {tool.device}] {info.description}".strip(),
                      input_schema=client_safe_schema(info.input_schema),
                      output_schema=servers_output_schema(info.output_schema),
                      annotations=_annotations(info))


def _annotations(info: ToolInfo) -> types.ToolAnnotations:
    from pydantic import ValidationError

    try:
        return types.ToolAnnotations.model_validate(tool_annotations(info))
    except ValidationError:  # a server's annotations MCP would not accept: the tool type's instead
        return types.ToolAnnotations.model_validate(tool_annotations(info.model_copy(update={"annotations": None})))


def contributed_tool(tool: GatewayTool) -> types.Tool:
    annotations = types.ToolAnnotations.model_validate({"readOnlyHint": tool.read_only,
                                                        "destructiveHint": tool.destructive, **tool.annotations})
    # a tool with tasks says so to 2025-11-25 clients (`execution.taskSupport`; the SDK drops it for 2026-07-28,
    # whose tasks extension is server-directed)
    execution = types.ToolExecution(task_support="optional") if tool.tasks is not None else None
    return types.Tool(name=tool.name, description=tool.description, input_schema=client_safe_schema(tool.input_schema),
                      output_schema=tool.output_schema, annotations=annotations, execution=execution)


COMBINATORS = ("anyOf", "oneOf", "allOf")
# what some clients' model APIs refuse at a tool schema's top level (Anthropic's: "input_schema does not support
# oneOf, allOf, or anyOf at the top level"); nested, they are accepted everywhere
TOP_LEVEL_REFUSED = (*COMBINATORS, "not", "enum", "const")


def client_safe_schema(schema: dict[str, Any] | None) -> dict[str, Any]:
    """`schema` as every major MCP client accepts a tool's input schema: `type: object` at the top, and none of
    `anyOf`, `oneOf`, `allOf`, `not`, `enum`, `const` there (nested ones stay). A schema already so is returned
    as it is (the same object). Otherwise it is flattened: the alternatives' `properties` merged into one
    object (the first alternative naming a property gives its schema), `required` keeping what every
    alternative of an `anyOf`/`oneOf` requires and all that an `allOf` requires, `additionalProperties` kept
    only when given at the top, `$defs` kept; the alternatives themselves are put into the description as
    JSON so a model still reads them. Validation of the exact shape stays with whoever serves the tool (an
    external MCP server checks its own arguments; the gateway's own tools check theirs)."""
    if not isinstance(schema, dict):
        return {"type": "object"}
    if schema.get("type") == "object" and not any(key in schema for key in TOP_LEVEL_REFUSED):
        return schema
    flat: dict[str, Any] = {key: value for key, value in schema.items() if key not in TOP_LEVEL_REFUSED}
    flat["type"] = "object"
    properties: dict[str, Any] = dict(schema.get("properties") or {})
    required: list[str] = list(schema.get("required") or [])
    moved: dict[str, Any] = {}
    for key in COMBINATORS:
        branches = [b for b in schema.get(key) or [] if isinstance(b, dict)]
        if not branches:
            continue
        moved[key] = schema[key]
        for branch in branches:
            for name, spec in (branch.get("properties") or {}).items():
                properties.setdefault(name, spec)
        needed = [set(b.get("required") or []) for b in branches]
        if key == "allOf":
            required += sorted(set().union(*needed) - set(required))
        else:
            required += sorted(set.intersection(*needed) - set(required))
    moved.update({key: schema[key] for key in ("not", "enum", "const") if key in schema})
    flat["properties"] = properties
    if required:
        flat["required"] = required
    else:
        flat.pop("required", None)
    if moved:
        note = "Arguments must also satisfy: " + json.dumps(moved, ensure_ascii=False, separators=(",", ":"))
        flat["description"] = f"{schema['description']}\n{note}" if isinstance(schema.get("description"), str) \
            else note
    return flat


def call_result(reply: Reply, *, as_json: bool = False, device: str | None = None) -> types.CallToolResult:
    """`reply` as the client reads it. An external MCP server's result (the device's `{text, content,
    structured}`) goes back as that server gave it: its own content items (text, images, audio, resource
    links, embedded resources, with their annotations) and its own structured content, not the device's
    envelope; a `resource_link` of a `device`'s server points at the gateway's URI for it (gateway_uri), so
    the client reads it with `resources/read` here. Anything else is one text (its JSON when `as_json`) with
    the object as structured content."""
    forwarded = external_content(reply.payload, device)
    if forwarded is not None:
        return types.CallToolResult(content=forwarded, structured_content=_servers_structured(reply.payload),
                                    is_error=reply.is_error)
    structured = reply.payload if isinstance(reply.payload, dict) else None
    text = json.dumps(reply.payload, ensure_ascii=False, default=str) if as_json else reply.text
    content: list[types.ContentBlock] = [types.TextContent(type="text", text=text)] if text else []
    return types.CallToolResult(content=content, structured_content=structured, is_error=reply.is_error)


@functools.cache
def _content_adapter() -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(types.ContentBlock)


EXTERNAL_SHAPE = frozenset({"text", "content", "structured"})


def is_external(payload: Any) -> bool:
    """Whether `payload` is the shape a device gives every external MCP tool's result."""
    return isinstance(payload, dict) and payload.keys() == EXTERNAL_SHAPE and isinstance(payload["content"], list)


def _servers_structured(payload: dict[str, Any]) -> Any:
    # the device unwraps the Python SDK's `{"result": x}` for plans; the server sent it wrapped
    structured = payload["structured"]
    return structured if structured is None or isinstance(structured, dict) else {"result": structured}


def servers_output_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """The output schema an external server gave its tool, out of the device's `{text, content, structured}`
    envelope schema around it (wrapped again as `{"result": ...}` when the device unwrapped it); any other
    schema as it is."""
    if not (isinstance(schema, dict) and schema.get("required") == ["text", "content", "structured"]):
        return schema
    inner = (schema.get("properties") or {}).get("structured")
    if not isinstance(inner, dict) or not inner:
        return None
    if inner.get("type") == "object":
        return inner
    return {"type": "object", "properties": {"result": inner}, "required": ["result"]}


def external_content(payload: Any, device: str | None = None) -> list[types.ContentBlock] | None:
    """The content items of an external MCP tool's result (`{text, content, structured}`), or None for
    anything else or an item MCP would not accept. The device's `server` note on a link is taken off; a
    `resource_link`'s URI becomes the gateway's for it when `device` is given."""
    if not is_external(payload):
        return None
    from pydantic import ValidationError

    items = []
    for item in payload["content"]:
        if not isinstance(item, dict):
            return None
        item = dict(item)
        server = item.pop("server", None)
        if item.get("type") == "resource_link" and device is not None and isinstance(server, str) \
                and isinstance(item.get("uri"), str):
            item["uri"] = gateway_uri(device, server, item["uri"])
        items.append(item)
    try:
        return [_content_adapter().validate_python(item) for item in items]
    except ValidationError:
        return None


GATEWAY_SCHEME = "tether"


def gateway_uri(device: str, server: str, uri: str, *, template: bool = False) -> str:
    """`tether://DEVICE/SERVER/URI`, each part percent-encoded: the URI at `/mcp` of resource `uri` of
    external MCP server `server` on `device` (read back by `parse_gateway_uri`). A `template` keeps its
    `{...}` expressions, so a client expanding it yields such a URI."""
    from urllib.parse import quote

    return f"{GATEWAY_SCHEME}://{quote(device, safe='')}/{quote(server, safe='')}/" \
           f"{quote(uri, safe='{}' if template else '')}"


def parse_gateway_uri(uri: str) -> tuple[str, str, str] | None:
    """(device, server, the server's own URI) of a `gateway_uri`, or None when `uri` is not one."""
    from urllib.parse import unquote

    prefix = f"{GATEWAY_SCHEME}://"
    if not uri.startswith(prefix):
        return None
    parts = uri[len(prefix):].split("/", 2)
    if len(parts) != 3 or not all(parts):
        return None
    device, server, inner = (unquote(p) for p in parts)
    return device, server, inner


def capped(reply: Reply, limit: int) -> Reply:
    """The REST API's answer size limit (`max_response_bytes`) for one result, text and structured twin."""
    size = len(reply.text.encode()) * (2 if isinstance(reply.payload, dict) else 1)
    if size <= limit:
        return reply
    return Reply(f"result too large for this answer: about {size} bytes, and the limit is {limit} bytes "
                 f"(max_response_bytes); the command itself {'failed' if reply.is_error else 'succeeded'} on the "
                 "device (see the audit log); ask for less output", {"too_large": True, "bytes": size,
                                                                     "limit": limit}, is_error=True)


MAX_ERROR_BODY = 64 * 1024  # an SDK error body larger than this is passed on as it is


def plain_errors(send: Any) -> Any:
    """`send` with the SDK's own HTTP errors (unknown session 404, server full 503, missing session id 400,
    406, 413, ...) answered as every other HTTP error of the server is, `{"error": MESSAGE}`, instead of a
    JSON-RPC error object without an id, and so are its transport's plain-text refusals (a POST that is not
    `application/json`: 400 `Invalid Content-Type header`). Status and headers are kept (MCP clients act on the
    status: a 404 means start a new session); the SDK's client reads such a body by its status as before. Anything
    else (a JSON body that is not a JSON-RPC error, an error past `MAX_ERROR_BODY`) passes unchanged."""
    held: dict[str, Any] | None = None  # an error's response start, until its body is known
    parts: list[bytes] = []
    text = False  # the held error's body is plain text (the SDK's transport checks: content type, host, origin)

    async def relay(message: dict[str, Any]) -> None:
        nonlocal held, text
        if held is None:
            if message["type"] == "http.response.start" and message["status"] >= 400 and not parts:
                kind = dict(message.get("headers", ())).get(b"content-type", b"")
                if kind == b"application/json" or not kind or kind.startswith(b"text/plain"):
                    held, text = message, kind != b"application/json"
                    return
            await send(message)
            return
        parts.append(message.get("body", b""))
        more = bool(message.get("more_body"))
        if more and sum(map(len, parts)) <= MAX_ERROR_BODY:
            return
        start, body, held = held, b"".join(parts), None
        plain = None if more else _plain_text_error(body) if text else _plain_error(body)
        if plain is None:  # not one to rewrite: what the SDK sent, as it sent it (the rest follows unheld)
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": more})
            return
        headers = [(k, v) for k, v in start.get("headers", ()) if k not in (b"content-length", b"content-type")]
        await send({**start, "headers": [*headers, (b"content-type", b"application/json"),
                                         (b"content-length", str(len(plain)).encode())]})
        await send({"type": "http.response.body", "body": plain})

    return relay


def _plain_text_error(body: bytes) -> bytes | None:
    """A plain-text error the SDK's transport answered (`Invalid Content-Type header`) as `{"error": TEXT}`."""
    try:
        message = body.decode().strip()
    except UnicodeDecodeError:
        return None
    return json.dumps({"error": message or "refused"}).encode()


def _plain_error(body: bytes) -> bytes | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) and parsed.get("jsonrpc") == "2.0" else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None
    return json.dumps({"error": error["message"]}).encode()
