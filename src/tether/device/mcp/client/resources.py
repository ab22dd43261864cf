"""Resources and prompts of a device's external MCP servers, as meta tools (seed 003's "meta tools").

An MCP server offers more than tools: resources (documents, blobs, anything with a URI; a tool may
return a `resource_link` to one) and prompts (message templates). Reaching them through tools keeps
one path for everything: the router, policy, audit, a remote device and `tether exec` all handle
`mcp.read_resource` as any other call. They take the server's namespace; `read_resource` may leave it
out when the device has a single external server (a `resource_link` in a tool result names its server,
see `tether.tools.toolsets.mcp_export`). Nothing here imports the `mcp` SDK: the requests run on each server's
own session (`BaseMCPServer.session_request`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from tether.device.mcp.client.base import BaseMCPServer
from tether.tools.context import ToolContext
from tether.tools.errors import ToolError
from tether.tools.runtime import ToolFunction, ToolSpec, build_spec

MAX_PAGES = 100  # a paginator that never ends must not hang the call
MAX_ITEMS = 10_000  # listed resources / templates / prompts kept in one answer


def _dump(item: Any) -> dict[str, Any]:
    return item.model_dump(mode="json", by_alias=True, exclude_none=True)


class MCPResourceTools:
    """The `mcp.*` meta tools of one computer; `servers` names its external servers as they are now."""

    def __init__(self, servers: Callable[[], Iterable[BaseMCPServer]],
                 joined: Callable[[], Awaitable[object]]) -> None:
        self._servers = servers
        self._joined = joined  # waits (bounded) for servers still starting

    def specs(self) -> dict[str, ToolSpec]:
        tools: list[tuple[ToolFunction, str, str]] = [
            (self.list_resources, "mcp.list_resources",
             "List an external MCP server's resources and resource templates (uri, name, mimeType)."),
            (self.read_resource, "mcp.read_resource",
             "Read an external MCP server's resource by uri (also how to follow a resource_link a tool "
             "returned): text contents joined in `text`, blobs base64 with their mimeType."),
            (self.list_prompts, "mcp.list_prompts", "List an external MCP server's prompts and their arguments."),
            (self.get_prompt, "mcp.get_prompt",
             "Get one prompt of an external MCP server, filled with its arguments (strings)."),
            (self.complete, "mcp.complete",
             "Ask an external MCP server to complete one argument of a prompt (ref_type=prompt, ref=its name) or "
             "of a resource template (ref_type=resource, ref=its uriTemplate): the values it suggests for the "
             "argument's partial `value`, given the other arguments in `context`."),
        ]
        return {name: build_spec(fn, name, "data_collection", None, doc) for fn, name, doc in tools}

    async def _server(self, name: str | None) -> BaseMCPServer:
        found = await self._find(name)
        if found is None:
            await self._joined()  # it may be one still starting
            found = await self._find(name)
        if found is not None:
            return found
        names = sorted({s.namespace for s in self._servers()})
        offered = (f"external MCP servers here: {', '.join(names)}" if names
                   else "this device has no external MCP server")
        if name is None:
            raise ToolError(f"give server=NAME ({offered})")
        raise ToolError(f"unknown MCP server '{name}' ({offered})")

    async def _find(self, name: str | None) -> BaseMCPServer | None:
        servers = {s.namespace: s for s in self._servers()}
        if name is None:
            return next(iter(servers.values())) if len(servers) == 1 else None
        return servers.get(name)

    @staticmethod
    def _timeout(server: BaseMCPServer, ctx: ToolContext) -> float:
        return server.config.timeout or ctx.policy.default_timeout

    async def _paged(self, server: BaseMCPServer, what: str, method: str, field: str,
                     ctx: ToolContext) -> list[dict[str, Any]]:
        async def fetch(client: Any) -> list[dict[str, Any]]:
            items: list[dict[str, Any]] = []
            cursor: str | None = None
            for _ in range(MAX_PAGES):
                page = await getattr(client, method)(cursor=cursor, cache_mode="refresh")
                items.extend(_dump(i) for i in getattr(page, field))
                cursor = page.next_cursor
                if not cursor or len(items) >= MAX_ITEMS:
                    break
            return items[:MAX_ITEMS]

        return await server.session_request(what, fetch, self._timeout(server, ctx))

    async def list_resources(self, ctx: ToolContext, server: str) -> dict[str, Any]:
        srv = await self._server(server)
        resources = await self._paged(srv, "resources/list", "list_resources", "resources", ctx)
        templates = await self._paged(srv, "resources/templates/list", "list_resource_templates",
                                      "resource_templates", ctx)
        return {"server": srv.namespace, "resources": resources, "templates": templates}

    async def read_resource(self, ctx: ToolContext, uri: str, server: str | None = None) -> dict[str, Any]:
        srv = await self._server(server)
        result = await srv.session_request(f"reading '{uri}'",
                                           lambda client: client.read_resource(uri, cache_mode="bypass"),
                                           self._timeout(srv, ctx))
        contents = [_dump(c) for c in result.contents]
        cap = srv.config.max_result_bytes
        size = sum(len(c.get("text", "")) + len(c.get("blob", "")) for c in contents)
        if size > cap:
            raise ToolError(f"resource '{uri}' of server '{srv.namespace}' is too large: {size} bytes, over the "
                            f"limit of {cap} bytes (max_result_bytes)",
                            {"too_large": True, "bytes": size, "limit": cap})
        text = "\n".join(c["text"] for c in contents if "text" in c)
        return {"server": srv.namespace, "uri": uri, "text": text, "contents": contents}

    async def list_prompts(self, ctx: ToolContext, server: str) -> dict[str, Any]:
        srv = await self._server(server)
        prompts = await self._paged(srv, "prompts/list", "list_prompts", "prompts", ctx)
        return {"server": srv.namespace, "prompts": prompts}

    async def get_prompt(self, ctx: ToolContext, server: str, name: str,
                         arguments: dict[str, str] | None = None) -> dict[str, Any]:
        srv = await self._server(server)
        result = await srv.session_request(f"prompt '{name}'",
                                           lambda client: client.get_prompt(name, arguments or None),
                                           self._timeout(srv, ctx))
        messages = [_dump(m) for m in result.messages]
        text = "\n".join(m["content"]["text"] for m in messages if m.get("content", {}).get("type") == "text")
        out: dict[str, Any] = {"server": srv.namespace, "name": name, "text": text, "messages": messages}
        if result.description:
            out["description"] = result.description
        return out

    async def complete(self, ctx: ToolContext, server: str, ref_type: str, ref: str, argument: str,
                       value: str = "", context: dict[str, str] | None = None) -> dict[str, Any]:
        """`completion/complete` on the server: `{server, values, total?, hasMore?}`; ToolError for a
        `ref_type` other than prompt/resource, or when the server does not offer completions or refuses."""
        if ref_type not in ("prompt", "resource"):
            raise ToolError(f"ref_type must be 'prompt' or 'resource', not {ref_type[:40]!r}")
        import mcp_types as types  # loaded already: the device runs an external MCP server

        srv = await self._server(server)
        target = (types.PromptReference(type="ref/prompt", name=ref) if ref_type == "prompt"
                  else types.ResourceTemplateReference(type="ref/resource", uri=ref))
        result = await srv.session_request(
            f"completing '{argument}' of {ref_type} '{ref}'",
            lambda client: client.complete(target, {"name": argument, "value": value}, context or None),
            self._timeout(srv, ctx))
        return {"server": srv.namespace, **_dump(result.completion)}
