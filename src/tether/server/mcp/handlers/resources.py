"""The resources and prompts of the fleet's external MCP servers, at `/mcp`.

A device reaches its external servers' resources and prompts through its `mcp.*` meta tools
(`mcp.list_resources`, `mcp.read_resource`, `mcp.list_prompts`, `mcp.get_prompt`); the gateway serves the
MCP methods (`resources/list`, `resources/templates/list`, `resources/read`, `prompts/list`, `prompts/get`)
by calling them as any device tool is called: through the dispatcher, policy and audit, for the token's
devices only (its scope and the connection's `?devices=` filter), and with the token's `execute` scope
(a read runs on the device). Names at `/mcp`:

- a resource is `tether://DEVICE/SERVER/URI` (`translate.gateway_uri`; a template keeps its `{...}`
  expressions, so its expansion reads back), everything else about it as the server gave it, and
  `_meta` names its device and server;
- a prompt is `DEVICE__SERVER__NAME` (device and server escaped as tool names are, listing.py).

A device's external servers are the namespaces of its listed tools that are not a built-in tool set, so a
server that offers no tool (only resources or prompts) is not found. Listing asks every such server of every
admitted device at once (`MAX_PARALLEL` at a time); one that fails or does not answer is left out of the list
(logged), not an error of the whole list.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import mcp_types as types
from mcp.shared.exceptions import MCPError
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS

from tether.protocol.models import ToolInfo
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.hub import DeviceHub
from tether.server.mcp.listing import SEPARATOR, DeviceFilter, DeviceTool, escape_name
from tether.server.mcp.tools.tool_call import Caller, Reply, call_device_tool
from tether.server.mcp.tools.translate import gateway_uri, parse_gateway_uri
from tether.server.store.audit import AuditLog

logger = logging.getLogger(__name__)

# a device's built-in tool sets and its meta tools: every other namespace of its tools is an external server
BUILT_IN = frozenset({"shell", "files", "system", "desktop", "browser", "meta", "mcp"})
MAX_PARALLEL = 16  # device calls of one listing at once
META = "tether/"  # this gateway's keys in an item's `_meta`


@dataclass(frozen=True, order=True)
class Source:
    """One external MCP server on one device."""

    device: str
    server: str


async def _no_progress(done: float, total: float | None, message: str | None) -> None:
    return None


class FleetResources:
    """The MCP resource and prompt methods over the admitted devices' external servers."""

    def __init__(self, hub: DeviceHub, registry: DeviceRegistry, audit: AuditLog) -> None:
        self.hub, self.registry, self.audit = hub, registry, audit

    def sources(self, keep: DeviceFilter) -> list[Source]:
        """The external servers of the online devices `keep` admits (a device too old for the `mcp.*` meta
        tools answers that it has no such tool, and is left out of a list)."""
        return sorted(Source(record.name, server) for record in self.registry.list() if keep.admits(record.name)
                      for server in self.servers_of(record.name))

    def servers_of(self, device: str) -> frozenset[str]:
        """The external MCP servers of `device` while it is online (none while it is offline or unknown)."""
        record = self.registry.get(device)
        if record is None or not record.connected or record.profile is None:
            return frozenset()
        return frozenset(t.namespace for t in record.profile.tools if not t.meta and t.namespace not in BUILT_IN)

    async def _call(self, source: Source, tool: str, arguments: dict[str, Any], caller: Caller) -> Reply:
        info = ToolInfo(name=tool, namespace="mcp", tool_type="data_collection", meta=True)
        return await call_device_tool(self.hub, DeviceTool(tool, source.device, info),
                                      {**arguments, "server": source.server}, caller, _no_progress, None,
                                      audit=self.audit)

    async def _each(self, keep: DeviceFilter, tool: str, caller: Caller) -> list[tuple[Source, dict[str, Any]]]:
        """`tool` on every source at once; the answers that came, in source order."""
        if not caller.token.allows("execute"):  # listing reads the devices: as their tools, it needs execute
            return []
        gate = asyncio.Semaphore(MAX_PARALLEL)

        async def one(source: Source) -> dict[str, Any] | None:
            async with gate:
                reply = await self._call(source, tool, {}, caller)
            if reply.is_error or not isinstance(reply.payload, dict):
                logger.info("MCP gateway: %s of server %s on device %s left out: %s", tool, source.server,
                            source.device, reply.text[:200])
                return None
            return reply.payload

        sources = self.sources(keep)
        answers = await asyncio.gather(*(one(s) for s in sources))
        return [(s, a) for s, a in zip(sources, answers, strict=True) if a is not None]

    # -- resources ------------------------------------------------------------------------------

    async def list_resources(self, keep: DeviceFilter, caller: Caller) -> types.ListResourcesResult:
        resources = []
        for source, answer in await self._each(keep, "mcp.list_resources", caller):
            for item in answer.get("resources") or []:
                if isinstance(item, dict) and isinstance(item.get("uri"), str):
                    resources.append(_valid(types.Resource, {**item, "uri": gateway_uri(
                        source.device, source.server, item["uri"]), "_meta": _meta(item, source)}))
        return types.ListResourcesResult(resources=[r for r in resources if r is not None])

    async def list_templates(self, keep: DeviceFilter, caller: Caller) -> types.ListResourceTemplatesResult:
        templates = []
        for source, answer in await self._each(keep, "mcp.list_resources", caller):
            for item in answer.get("templates") or []:
                if isinstance(item, dict) and isinstance(item.get("uriTemplate"), str):
                    templates.append(_valid(types.ResourceTemplate, {**item, "uriTemplate": gateway_uri(
                        source.device, source.server, item["uriTemplate"], template=True),
                        "_meta": _meta(item, source)}))
        return types.ListResourceTemplatesResult(resource_templates=[t for t in templates if t is not None])

    async def read(self, keep: DeviceFilter, caller: Caller, uri: str) -> types.ReadResourceResult:
        """The resource's contents as its server gave them (their URIs the gateway's); MCPError
        INVALID_PARAMS for a URI that names no resource here, INTERNAL_ERROR when the device's read failed."""
        parsed = parse_gateway_uri(uri)
        if parsed is None:
            raise MCPError(INVALID_PARAMS, f"resource not found: {uri[:200]!r} is not a resource of this gateway "
                           "(they are tether://DEVICE/SERVER/URI, as resources/list gives them)")
        device, server, inner = parsed
        source = Source(device, server)
        if source not in self.sources(keep):  # outside the scope and unknown are told alike
            raise MCPError(INVALID_PARAMS, f"resource not found: no external MCP server {server!r} on an online "
                           f"device {device!r} this connection reaches")
        reply = await self._call(source, "mcp.read_resource", {"uri": inner}, caller)
        if reply.is_error or not isinstance(reply.payload, dict):
            raise MCPError(INTERNAL_ERROR, reply.text)
        contents = []
        for item in reply.payload.get("contents") or []:
            if isinstance(item, dict) and isinstance(item.get("uri"), str):
                item = {**item, "uri": gateway_uri(device, server, item["uri"])}
            contents.append(_content_item(item))
        return types.ReadResourceResult(contents=[c for c in contents if c is not None])

    # -- prompts --------------------------------------------------------------------------------

    async def list_prompts(self, keep: DeviceFilter, caller: Caller) -> types.ListPromptsResult:
        prompts = []
        for source, answer in await self._each(keep, "mcp.list_prompts", caller):
            for item in answer.get("prompts") or []:
                if isinstance(item, dict) and isinstance(item.get("name"), str):
                    meta = {**_meta(item, source), META + "name": item["name"]}
                    prompts.append(_valid(types.Prompt, {**item, "name": prompt_name(source, item["name"]),
                                                         "_meta": meta}))
        return types.ListPromptsResult(prompts=[p for p in prompts if p is not None])

    async def get_prompt(self, keep: DeviceFilter, caller: Caller, name: str,
                         arguments: dict[str, str] | None) -> types.GetPromptResult:
        """The prompt filled in by its server (resource links in it pointing here); MCPError INVALID_PARAMS
        for a name that names no prompt source here, INTERNAL_ERROR when the device's call failed."""
        source = self._prompt_source(keep, name)
        reply = await self._call(source, "mcp.get_prompt", {"name": name[len(_prefix(source)):],
                                                            "arguments": dict(arguments or {})}, caller)
        if reply.is_error or not isinstance(reply.payload, dict):
            raise MCPError(INTERNAL_ERROR, reply.text)
        messages = []
        for message in reply.payload.get("messages") or []:
            if isinstance(message, dict) and isinstance(message.get("content"), dict):
                message = {**message, "content": _relinked(message["content"], source)}
            messages.append(_valid(types.PromptMessage, message))
        description = reply.payload.get("description")
        return types.GetPromptResult(description=description if isinstance(description, str) else None,
                                     messages=[m for m in messages if m is not None])


    def _prompt_source(self, keep: DeviceFilter, name: str) -> Source:
        matches = [s for s in self.sources(keep) if name.startswith(_prefix(s)) and len(name) > len(_prefix(s))]
        if not matches:
            raise MCPError(INVALID_PARAMS, f"unknown prompt {name[:120]!r}: prompts here are DEVICE__SERVER__NAME, "
                           "as prompts/list gives them, of the online devices this connection reaches")
        return max(matches, key=lambda s: len(_prefix(s)))

    # -- completion -------------------------------------------------------------------------------

    async def complete(self, keep: DeviceFilter, caller: Caller,
                       params: types.CompleteRequestParams) -> types.CompleteResult:
        """`completion/complete` of a prompt's or resource template's argument, answered by the external
        server that owns it (through its device's `mcp.complete`); MCPError INVALID_PARAMS for a prompt or
        template that is not this gateway's, INTERNAL_ERROR when the device or server could not complete."""
        ref = params.ref
        if isinstance(ref, types.PromptReference):
            source = self._prompt_source(keep, ref.name)
            arguments = {"ref_type": "prompt", "ref": ref.name[len(_prefix(source)):]}
        else:
            parsed = parse_gateway_uri(ref.uri)
            if parsed is None or Source(parsed[0], parsed[1]) not in self.sources(keep):
                raise MCPError(INVALID_PARAMS, f"unknown resource template {ref.uri[:200]!r}: templates here are "
                               "tether://DEVICE/SERVER/TEMPLATE, as resources/templates/list gives them, of the "
                               "online devices this connection reaches")
            source = Source(parsed[0], parsed[1])
            arguments = {"ref_type": "resource", "ref": parsed[2]}
        if not caller.token.allows("execute"):  # as a read, completing runs on the device
            raise MCPError(INVALID_PARAMS, f"token '{caller.token.name}' lacks the 'execute' scope that completing "
                           "an argument on a device needs")
        context = params.context.arguments if params.context is not None else None
        reply = await self._call(source, "mcp.complete", {**arguments, "argument": params.argument.name,
                                                          "value": params.argument.value,
                                                          "context": dict(context or {})}, caller)
        if reply.is_error or not isinstance(reply.payload, dict):
            raise MCPError(INTERNAL_ERROR, reply.text)
        answer = {k: v for k, v in reply.payload.items() if k in ("values", "total", "hasMore")}
        completion = _valid(types.Completion, answer)
        if completion is None:
            raise MCPError(INTERNAL_ERROR, f"server {source.server!r} on device {source.device!r} answered a "
                           "completion MCP does not accept")
        return types.CompleteResult(completion=completion)


def prompt_name(source: Source, name: str) -> str:
    """`DEVICE__SERVER__NAME`: a server's prompt as `/mcp` lists it."""
    return _prefix(source) + name


def _prefix(source: Source) -> str:
    return f"{escape_name(source.device)}{SEPARATOR}{escape_name(source.server)}{SEPARATOR}"


def _meta(item: dict[str, Any], source: Source) -> dict[str, Any]:
    own = item.get("_meta")
    return {**(own if isinstance(own, dict) else {}), META + "device": source.device, META + "server": source.server}


def _relinked(content: dict[str, Any], source: Source) -> dict[str, Any]:
    """A content item with a `resource_link`'s URI made the gateway's (an embedded resource keeps its own)."""
    content = {k: v for k, v in content.items() if k != "server"}
    if content.get("type") == "resource_link" and isinstance(content.get("uri"), str):
        content["uri"] = gateway_uri(source.device, source.server, content["uri"])
    return content


def _content_item(item: Any) -> types.TextResourceContents | types.BlobResourceContents | None:
    if not isinstance(item, dict):
        return None
    return _valid(types.BlobResourceContents if "blob" in item else types.TextResourceContents, item)


def _valid(model: Any, item: dict[str, Any]) -> Any:
    """`item` as `model`, or None (logged) when the server sent something MCP would not accept."""
    from pydantic import ValidationError

    try:
        return model.model_validate(item)
    except ValidationError as exc:
        logger.info("MCP gateway: a %s from a device's MCP server left out: %s", model.__name__, exc)
        return None
