"""The gateway's lists: tools (the fleet tools, contributed ones and every device's, or `find_tools` when the fleet
is too big to list), and the resources and prompts of the devices' external MCP servers; each paged, each the
token's own view of the fleet."""


from __future__ import annotations

from typing import Any

import mcp_types as types
from mcp.server.context import ServerRequestContext
from starlette.applications import Starlette

from tether.server.mcp.contributed import contributed
from tether.server.mcp.handlers.context import admitted_of, caller_of
from tether.server.mcp.handlers.paging import checked_cursor, page
from tether.server.mcp.handlers.resources import FleetResources
from tether.server.mcp.listing import LIST_DEVICES_INPUT, LIST_DEVICES_OUTPUT, FleetIndex
from tether.server.mcp.tools import search
from tether.server.mcp.tools.translate import contributed_tool, device_tool


class GatewayLists:
    """The listing part of `tether.server.mcp.gateway.Gateway`, which sets every attribute below in its
    constructor."""

    app: Starlette
    index: FleetIndex
    resources: FleetResources
    _page_size: int
    _progressive_over: int

    async def _list_tools(self, ctx: ServerRequestContext[Any],
                          params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        admitted = admitted_of(ctx)
        tools = [types.Tool(name="list_devices", description="The fleet's devices: status, platform, tags, how "
                            "many tools, sandbox, running and queued work.", input_schema=LIST_DEVICES_INPUT,
                            output_schema=LIST_DEVICES_OUTPUT,
                            annotations=types.ToolAnnotations(read_only_hint=True, destructive_hint=False))]
        tools += [contributed_tool(t) for t in contributed(self.app).values()]
        listed = self.index.listed(admitted.keep)
        big = search.progressive(len(listed), self._progressive_over)  # a big fleet: searched, not listed
        tools += [search.search_tool()] if big else [device_tool(t) for t in listed]
        shown, more = page("tools/list", tools, checked_cursor(params), self._page_size)
        return types.ListToolsResult(tools=shown, next_cursor=more)

    # -- resources and prompts of the devices' external MCP servers (handlers/resources.py) --------------

    async def _list_resources(self, ctx: ServerRequestContext[Any],
                              params: types.PaginatedRequestParams | None) -> types.ListResourcesResult:
        admitted = admitted_of(ctx)
        checked_cursor(params, "resources/list")  # an invalid cursor is refused before the devices are asked
        listed = await self.resources.list_resources(admitted.keep, caller_of(ctx, admitted))
        shown, more = page("resources/list", listed.resources, checked_cursor(params), self._page_size)
        return types.ListResourcesResult(resources=shown, next_cursor=more)

    async def _list_templates(self, ctx: ServerRequestContext[Any],
                              params: types.PaginatedRequestParams | None) -> types.ListResourceTemplatesResult:
        admitted = admitted_of(ctx)
        checked_cursor(params, "resources/templates/list")
        listed = await self.resources.list_templates(admitted.keep, caller_of(ctx, admitted))
        shown, more = page("resources/templates/list", listed.resource_templates, checked_cursor(params),
                           self._page_size)
        return types.ListResourceTemplatesResult(resource_templates=shown, next_cursor=more)

    async def _read_resource(self, ctx: ServerRequestContext[Any],
                             params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        admitted = admitted_of(ctx)
        return await self.resources.read(admitted.keep, caller_of(ctx, admitted), str(params.uri))

    async def _list_prompts(self, ctx: ServerRequestContext[Any],
                            params: types.PaginatedRequestParams | None) -> types.ListPromptsResult:
        admitted = admitted_of(ctx)
        checked_cursor(params, "prompts/list")
        listed = await self.resources.list_prompts(admitted.keep, caller_of(ctx, admitted))
        shown, more = page("prompts/list", listed.prompts, checked_cursor(params), self._page_size)
        return types.ListPromptsResult(prompts=shown, next_cursor=more)

    async def _get_prompt(self, ctx: ServerRequestContext[Any],
                          params: types.GetPromptRequestParams) -> types.GetPromptResult:
        admitted = admitted_of(ctx)
        return await self.resources.get_prompt(admitted.keep, caller_of(ctx, admitted), params.name,
                                               params.arguments)

    async def _complete(self, ctx: ServerRequestContext[Any],
                        params: types.CompleteRequestParams) -> types.CompleteResult:
        admitted = admitted_of(ctx)
        return await self.resources.complete(admitted.keep, caller_of(ctx, admitted), params)
