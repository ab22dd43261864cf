"""`/api/v1/health` and the devices: the list (filtered, paged), one device, its tools."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import Response

from tether.protocol.models import Command, ToolInfo
from tether.server.aip.fleet.record import DeviceRecord
from tether.server.aip.hub import DeviceHub
from tether.server.http.api import (
    ERROR_RESPONSES,
    DeviceDetail,
    DeviceView,
    _hub,
    _record,
    _registry,
    _store,
    _view,
    require,
)
from tether.server.store.tokens import TokenInfo

router = APIRouter(prefix="/api/v1", responses=ERROR_RESPONSES)


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    hub = _hub(request)
    online = [r.name for r in _registry(request).list() if r.status != "offline"]
    store = _store(request)
    audit = store.audit
    problem = audit.health()  # from state: no statement runs here (docs/database.md)
    writable = problem is None  # commands are refused (503) while it is not
    tasks = getattr(request.app.state, "tasks", None)  # the task service, where the agent is mounted
    # and statements of the other tables waiting for the database (a lock on one, a stalled database)
    stalled = "; ".join(r for r in (problem, store.stalled(), tasks.stalled() if tasks is not None else None) if r
                        ) or None
    body: dict[str, Any] = {"status": "ok" if stalled is None else "degraded", "devices_online": len(online),
                            "database": "ok" if stalled is None else f"degraded: {stalled}",
                            "audit_writable": writable, "audit_held": audit.held}
    cluster = getattr(request.app.state, "cluster", None)
    if cluster is not None:  # tether server --cluster: this node, its peers and the backplane
        info = cluster.health()
        body["node"] = info["node"]
        body["devices_here"] = len(hub.local_devices())
        body["cluster"] = {"nodes": info["nodes"], "backplane": info["backplane"]}
        if info["backplane"] != "ok":
            body["status"] = "degraded"
    return body


MAX_DEVICE_PAGE = 1000


def _here(hub: DeviceHub) -> str | None:
    """This node's name in a cluster (the `node` of the devices it holds), else None."""
    return hub.remote.node if hub.remote is not None else None


def _row(record: DeviceRecord, here: str | None = None) -> dict[str, Any]:
    """A `DeviceView` as a plain dict: a page is built without a model per device."""
    profile = record.profile
    return {"name": record.name, "status": record.status, "platform": record.platform,
            "last_seen": record.last_seen, "load": record.load,
            "running": max(record.running - record.queued, 0), "queued": record.queued,
            "capabilities": list(profile.capabilities) if profile else [], "tags": list(record.tags),
            "gpu": bool(profile and profile.gpu.available), "address": record.address,
            "sandbox": profile.sandbox if profile else None,
            "node": record.node or (here if record.connected else None)}


@router.get("/devices", response_model=list[DeviceView], responses={200: {"headers": {"Link": {
    "description": 'with `limit`, when more devices follow: `<same query, cursor=…>; rel="next"`',
    "schema": {"type": "string"}}}}})
async def list_devices(
        request: Request, who: Annotated[TokenInfo, Depends(require("read"))],
        status: Annotated[Literal["online", "busy", "offline"] | None, Query(description="only these")] = None,
        platform: Annotated[str | None, Query(max_length=128, description="without case")] = None,
        tag: Annotated[list[str] | None, Query(description="every one of these tags (repeatable)")] = None,
        name: Annotated[str | None, Query(max_length=256, description="a glob: `lab-*`")] = None,
        limit: Annotated[int | None, Query(ge=1, le=MAX_DEVICE_PAGE, description="a page of at most this "
                                           "many; without it, every match")] = None,
        cursor: Annotated[str | None, Query(max_length=256, description="the `cursor` of the previous "
                                            "page's Link: rel=next")] = None) -> Response:
    """Devices by name, filtered in the registry's indexes: a page costs what it holds, not the fleet.
    The body stays a plain list (older clients read it as before); the next page is in `Link`."""
    if tag is not None and len(tag) > 32:
        raise HTTPException(422, "at most 32 tag filters")
    records, after = _registry(request).page(status=status, platform=platform, tags=tag or (), name=name,
                                                 after=cursor, limit=limit)
    if who.scoped:  # the devices outside the token's scope are not there for it (a page may come out short)
        records = [r for r in records if who.reaches(r.name, r.tags)]
    headers = {}
    if after is not None:
        following = request.url.include_query_params(cursor=after)
        headers["Link"] = f'<{following.path}?{following.query}>; rel="next"'
    here = _here(_hub(request))
    return Response(json.dumps([_row(r, here) for r in records], separators=(",", ":")),
                    media_type="application/json", headers=headers)


@router.get("/devices/{name}", response_model=DeviceDetail)
async def get_device(name: str, request: Request,
                     who: Annotated[TokenInfo, Depends(require("read"))]) -> DeviceView:
    hub = _hub(request)
    return _view(_record(_registry(request), name, who), detail=True, here=_here(hub))


@router.get("/devices/{name}/tools", response_model=list[ToolInfo])
async def device_tools(name: str, request: Request, who: Annotated[TokenInfo, Depends(require("read"))],
                       live: bool = True, hints: bool = False) -> Any:
    """The device's tools: asked live when it is online (tools can change), else from its profile.

    `hints=true`: each tool also carries its external MCP server's `title` and `annotations` (readOnlyHint,
    destructiveHint, ...) where the server gave them (from the device's profile). Only on request: a CLI or
    client of an earlier version validates each tool with a model that refuses fields it does not know."""
    hub = _hub(request)
    record = _record(_registry(request), name, who)
    tools: list[ToolInfo] | None = None
    if live and record.status != "offline":
        dispatcher = hub.dispatcher(name, requested_by=f"api:{who.name}")
        [result] = await dispatcher.execute_commands([Command(tool_name="list_tools",
                                                              tool_type="data_collection")], timeout=30)
        if result.ok and isinstance(result.result, list):
            tools = [ToolInfo.model_validate(t) for t in result.result]
    if tools is None:
        if record.profile is None:
            raise HTTPException(409, f"device '{name}' is offline and has never reported its tools")
        tools = record.profile.tools
    if not hints:
        return tools
    known = {t.name: t.hints() for t in (record.profile.tools if record.profile is not None else [])}
    return Response(json.dumps([{**t.model_dump(mode="json"), **(t.hints() or known.get(t.name) or {})}
                                for t in tools]), media_type="application/json")
