"""The REST API beside the AIP endpoint: devices, their tools, running commands, tokens, audit.

Bearer tokens in the `Authorization` header carry scopes: `read` (look), `execute` (run
commands), `admin` (tokens and audit; implies the others). Every error body is
`{"error": "<what is wrong>"}` so a script can show it as is.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from inspect import Parameter, Signature
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from tether.protocol.identity import fingerprint
from tether.protocol.messages import Event
from tether.protocol.models import Command, Result, ToolInfo, new_call_id
from tether.protocol.profile import DeviceProfile, DeviceRequirements
from tether.server.aip.batches import TokenRef
from tether.server.aip.hub import DeviceHub
from tether.server.aip.registry import DeviceRecord, DeviceRegistry, NoDeviceError
from tether.server.approvals import ApprovalRefused, check_approver, check_four_eyes, how_a_person_approves
from tether.server.device_keys import device_key, parse_public_key, set_device_key
from tether.server.http import internals
from tether.server.http.coalesce import ON_DISCONNECT
from tether.server.http.front import FastRoute
from tether.server.http.request_guard import receive_body
from tether.server.ports import BackplaneUnavailable
from tether.server.scopes import beyond, reached_names, reaches, unknown_device, within
from tether.server.sessions import owned_session
from tether.server.store import Store
from tether.server.store.tokens import AGENT_NEVER, SCOPE_DEVICE, SCOPE_TAG, TokenInfo


class ErrorBody(BaseModel):
    """The body of every error answer: what is wrong, in words a script can show as is."""

    error: str


# Documented for every route, so the OpenAPI document says what 401/403/404/409/413/422 look like
# (a "4XX" entry also replaces FastAPI's default 422 schema, which would promise {"detail": [...]}).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {"4XX": {"model": ErrorBody, "description": "Client Error"}}

router = APIRouter(prefix="/api/v1", responses=ERROR_RESPONSES)



class DeviceView(BaseModel):
    name: str
    status: str
    platform: str | None = None
    last_seen: float | None = None
    load: int = 0
    running: int = Field(0, description="batches running on the device (its last heartbeat)")
    queued: int = Field(0, description="batches the device accepted and has not started (its last heartbeat)")
    capabilities: list[str] = Field(default_factory=list)
    tags: list[str] = Field(default_factory=list)
    gpu: bool = False
    address: str | None = None
    sandbox: str | None = None
    node: str | None = Field(None, description="in a cluster: the node holding the device's socket")


class DeviceDetail(DeviceView):
    profile: DeviceProfile | None = None


class CommandBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    commands: list[Command] = Field(..., min_length=1)
    timeout: float = Field(60.0, gt=0, le=24 * 3600)
    early_exit: bool = True
    session_id: str | None = None
    agent_name: str | None = None
    process_name: str | None = None
    root_name: str | None = None


class SelectedBatch(CommandBatch):
    requires: DeviceRequirements = Field(default_factory=DeviceRequirements)


class BatchResults(BaseModel):
    device: str
    results: list[Result]


class TokenRequest(BaseModel):
    # scopes (and device/tag scopes) are for API tokens; a device token has none (said in the document too)
    # and only an API token is an agent's, which holds neither approve nor admin (docs/security/approvals.md)
    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [
        {"properties": {"kind": {"const": "api"}}},
        {"properties": {"scopes": {"maxItems": 0}, "devices": {"maxItems": 0}, "tags": {"maxItems": 0}}}], "allOf": [
        {"anyOf": [{"properties": {"kind": {"const": "api"}}}, {"properties": {"agent": {"const": False}}}]},
        {"anyOf": [{"properties": {"agent": {"const": False}}},
                   {"properties": {"scopes": {"items": {"enum": ["read", "execute"]}}}}]},
        {"anyOf": [{"properties": {"kind": {"const": "device"}}}, {"properties": {"public_key": {"const": None}}}]}]})

    kind: Literal["device", "api"]
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
    scopes: list[Literal["read", "execute", "approve", "admin", "sample"]] = Field(default_factory=list)
    devices: list[Annotated[str, Field(pattern=SCOPE_DEVICE.pattern)]] = Field(
        default_factory=list, max_length=100, description="an API token: the devices it reaches (names or globs); "
                                                          "none = all")
    tags: list[Annotated[str, Field(pattern=SCOPE_TAG.pattern)]] = Field(
        default_factory=list, max_length=100, description="an API token: it also reaches the devices with one of "
                                                          "these tags")
    agent: bool = Field(False, description="an agent's API token: it may read and run, never approve (no approve "
                                           "or admin scope); `tether mcp config` makes these")
    public_key: str | None = Field(None, max_length=1000, description=(
        "a device token: the device's Ed25519 public key (as `tether device key` prints it, or PEM), enrolled "
        "now instead of at its first registration; a device whose key is enrolled already must be given that "
        "key (another one is `tether token rotate --device NAME --key ...`)"))


class TokenCreated(BaseModel):
    token: str
    info: dict[str, Any]


def _hub(request: Request) -> DeviceHub:
    return request.app.state.hub


def _store(request: Request) -> Store:
    return request.app.state.store


def _registry(request: Request) -> DeviceRegistry:
    return request.app.state.registry


def require(scope: str):
    """A dependency that admits an API token holding `scope` (or `admin`)."""

    async def check(request: Request, authorization: Annotated[str | None, Header()] = None) -> TokenInfo:
        return authorize(request, authorization, scope)

    return check


def authorize(request: Request, authorization: str | None, scope: str) -> TokenInfo:
    """The API token of this request if it holds `scope`; else the 401/403 `HTTPException` saying why."""
    sessions = getattr(request.app.state, "web_sessions", None)  # the dashboard's cookie (server/web)
    if not authorization and sessions is not None and (secret := sessions.bearer_for(request)):
        authorization = f"Bearer {secret}"  # CSRF already checked; the token is checked as any other
    if not authorization or not authorization.lower().startswith("bearer "):
        raise HTTPException(401, "missing bearer token: send 'Authorization: Bearer <api token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    info = _store(request).tokens.verify(authorization[7:].strip())
    if info is None:
        raise HTTPException(401, "unknown or revoked token", headers={"WWW-Authenticate": "Bearer"})
    if info.kind != "api":
        raise HTTPException(403, "a device token cannot use the API; create one with "
                                 "'tether token create --api'")
    if info.agent and scope == "approve":  # approving is a person's: say how a person does it
        raise HTTPException(403, f"token '{info.name}' is an agent's token, and an agent never approves or answers "
                                 f"a person's question: {how_a_person_approves(str(request.base_url))}")
    if info.agent and scope in AGENT_NEVER:
        raise HTTPException(403, f"token '{info.name}' is an agent's token, which never holds the '{scope}' scope "
                                 "(an admin could make itself a person's token); ask a person with an admin token")
    if not info.allows(scope):
        raise HTTPException(403, f"token '{info.name}' lacks the '{scope}' scope (has {info.scopes})")
    return info


def _view(record: DeviceRecord, detail: bool = False, here: str | None = None) -> DeviceView:
    profile = record.profile
    data: dict[str, Any] = {
        "name": record.name, "status": record.status, "last_seen": record.last_seen, "load": record.load,
        "running": max(record.running - record.queued, 0), "queued": record.queued,
        "platform": profile.os.platform if profile else None,
        "capabilities": profile.capabilities if profile else [],
        "tags": profile.tags if profile else [], "gpu": bool(profile and profile.gpu.available),
        "address": getattr(record, "address", None), "sandbox": profile.sandbox if profile else None,
        "node": record.node or (here if record.connected else None),
    }
    return DeviceDetail(**data, profile=profile) if detail else DeviceView(**data)


def _record(registry: DeviceRegistry, name: str, who: TokenInfo | None = None) -> DeviceRecord:
    """The device's record; 404 when none registered, or when `who` is a token whose scope leaves it out."""
    record = registry.get(name)
    if who is not None and who.scoped and (record is None or not who.reaches(name, record.tags)):
        raise HTTPException(404, unknown_device(who, name))
    if record is None:
        raise HTTPException(404, f"no device named '{name}'")
    return record


def in_scope(registry: DeviceRegistry, who: TokenInfo, name: str) -> None:
    """404 `{"error"}` naming the scope unless `who` reaches the device (known or not yet known here)."""
    if not reaches(who, registry, name):
        raise HTTPException(404, unknown_device(who, name))


async def _reachable(hub: DeviceHub, registry: DeviceRegistry, name: str, who: TokenInfo | None = None) -> None:
    """404 for a device no node knows (or outside `who`'s scope); in a cluster, 503 while the backplane is
    away for a device whose socket is not here (where it is cannot be known, and guessing would diverge)."""
    if who is not None:
        in_scope(registry, who, name)
    if hub.remote is None or hub.holds(name):
        _record(registry, name)
        return
    # unknown here: registered on another node a moment ago (a known one with the backplane away: `_run` 503s)
    if registry.get(name) is None:
        try:
            holder = await hub.remote.holder(name)
        except BackplaneUnavailable as exc:
            raise HTTPException(503, str(exc), headers={"Retry-After": "5"}) from None
        if holder is None:
            raise HTTPException(404, f"no device named '{name}'")
        registry.held_elsewhere(name, holder)


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    hub = _hub(request)
    online = [r.name for r in _registry(request).list() if r.status != "offline"]
    audit = _store(request).audit
    writable = audit.problem() is None  # commands are refused (503) while it is not
    body: dict[str, Any] = {"status": "ok" if writable else "degraded", "devices_online": len(online),
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
                       live: bool = True) -> list[ToolInfo]:
    """The device's tools: asked live when it is online (tools can change), else from its profile."""
    hub = _hub(request)
    record = _record(_registry(request), name, who)
    if live and record.status != "offline":
        dispatcher = hub.dispatcher(name, requested_by=f"api:{who.name}")
        [result] = await dispatcher.execute_commands([Command(tool_name="list_tools",
                                                              tool_type="data_collection")], timeout=30)
        if result.ok and isinstance(result.result, list):
            return [ToolInfo.model_validate(t) for t in result.result]
    if record.profile is None:
        raise HTTPException(409, f"device '{name}' is offline and has never reported its tools")
    return record.profile.tools


def _select(registry: DeviceRegistry, requires: DeviceRequirements, who: TokenInfo | None = None) -> str:
    """The device a batch with `requires` goes to, chosen among those `who` reaches; 409 when none fits."""
    try:
        return registry.select(requires, within(who) if who is not None else None).name
    except NoDeviceError as exc:
        raise HTTPException(409, str(exc) + (beyond(who) if who is not None else "")) from None


# -- the command routes ----------------------------------------------------------------------------------
# One implementation per route, taking the `Request` alone: the app answers their paths with it ahead of
# FastAPI's stack (front.py `FastRoutes`), and FastAPI documents it (a `FastRoute`, for the OpenAPI document and
# its fuzzing) from the signature `command_route` gives it, without solving dependencies or parsing the body.

FastHandler = Callable[[Request], Awaitable[Any]]


def command_route(path: str, body: type[CommandBatch], *, on_device: bool) -> Callable[[FastHandler], FastHandler]:
    """Register the decorated handler on `router` as `POST {path}`, documented as taking the device `name` from
    the path (when `on_device`), a JSON `body`, and a bearer token holding the `execute` scope (`require`),
    and answering `BatchResults` or, with `Accept: text/event-stream`, server-sent events. The handler itself
    takes the `Request` alone and does those checks; it is returned unchanged but for its `__signature__`,
    which is what FastAPI reads."""

    def register(handler: FastHandler) -> FastHandler:
        parameters = [Parameter("name", Parameter.POSITIONAL_OR_KEYWORD, annotation=str)] if on_device else []
        parameters += [Parameter("batch", Parameter.POSITIONAL_OR_KEYWORD, annotation=body),
                       Parameter("request", Parameter.POSITIONAL_OR_KEYWORD, annotation=Request),
                       Parameter("who", Parameter.POSITIONAL_OR_KEYWORD,
                                 annotation=Annotated[TokenInfo, Depends(require("execute"))])]
        handler.__signature__ = Signature(parameters, return_annotation=Any)  # type: ignore[attr-defined]
        router.add_api_route(path, handler, methods=["POST"], response_model=BatchResults,
                             responses={200: {"content": {"text/event-stream": {}}}}, route_class_override=FastRoute)
        return handler

    return register


async def _fast_batch(model: type[CommandBatch], body: bytes) -> CommandBatch:
    """The body as `model`, or 422 `{"error": …}` worded as the app's validation handler words it."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in ('body', *e['loc']))}: {e['msg']}"
                             for e in exc.errors()[:10])
        raise HTTPException(422, f"invalid request: {problems}") from None


async def read_body(request: Request) -> bytes:
    """The request body, read straight off `receive` (and kept where `Request.body()` finds it): Starlette's
    `body()` runs an async generator per request, with the loop's hooks for it."""
    body = await receive_body(request.receive)
    if body is None:
        raise ClientDisconnect()
    internals.keep_body(request, body)
    return body


@command_route("/devices/{name}/commands", CommandBatch, on_device=True)
async def run_commands(request: Request) -> Any:
    """Run a batch on one device. With `Accept: text/event-stream` the progress events and then
    the results stream as server-sent events; otherwise the call waits and returns the results."""
    body = await read_body(request)  # first, as FastAPI does: an oversized body is a 413 before anything else
    who = authorize(request, request.headers.get("authorization"), "execute")
    batch = await _fast_batch(CommandBatch, body)
    name = request.path_params["name"]
    await _reachable(_hub(request), _registry(request), name, who)
    return await _run(request, name, batch, who)


@command_route("/commands", SelectedBatch, on_device=False)
async def run_selected(request: Request) -> Any:
    """Run a batch on the least-loaded online device that meets `requires`."""
    body = await read_body(request)  # first, as FastAPI does: an oversized body is a 413 before anything else
    who = authorize(request, request.headers.get("authorization"), "execute")
    batch = await _fast_batch(SelectedBatch, body)
    assert isinstance(batch, SelectedBatch)
    return await _run(request, _select(_registry(request), batch.requires, who), batch, who)


def require_approver(who: TokenInfo, what: str, how: str | None = None, *, requested_by: str | None = None,
                     settings: Any = None) -> None:
    """403 `{"error"}` unless `who` may approve: a person's token (never an agent's) holding `approve`, and,
    with the server's `four_eyes` on (`settings`), not the token that asked (`requested_by`). `how` says how
    a person approves instead (`approvals.how_a_person_approves`)."""
    try:
        check_approver(who, what, how or how_a_person_approves(None))
        check_four_eyes(bool(getattr(settings, "four_eyes", False)), requested_by, f"api:{who.name}", what)
    except ApprovalRefused as exc:
        raise HTTPException(exc.status, str(exc)) from None


def stamp_approvals(commands: list[Command], who: TokenInfo, request: Request | None = None,
                    device: str | None = None) -> None:
    """A command sent as approved is approved by the caller, who must be a person holding the `approve`
    scope (with four-eyes on, never: the sender asked for it); the audit log names the token, whatever
    name the caller wrote. Its `approval_digest` (what the person was shown) goes on to the device."""
    if not any(c.approved_by for c in commands):
        return
    first = next(c for c in commands if c.approved_by)
    base = str(request.base_url) if request is not None else None
    settings = getattr(request.app.state, "settings", None) if request is not None else None
    require_approver(who, "send commands marked approved",
                     how_a_person_approves(base, device=device, tool=first.tool_name),
                     requested_by=f"api:{who.name}", settings=settings)
    for command in commands:
        if command.approved_by:
            command.approved_by = f"api:{who.name}"


BATCH_HEADER = "X-Tether-Batch"  # the batch's id, sent before any result: DELETE /api/v1/batches/{id}
CALLER_GONE = "cancelled: the HTTP caller disconnected before the batch finished"


def refuse_unaudited(store: Store) -> None:
    """503 `{"error": …}` before anything is sent while the audit log cannot be written (a full or
    read-only disk): a command that cannot be audited is not run."""
    problem = store.audit.problem()
    if problem is not None:
        raise HTTPException(503, f"refused, nothing was run: {problem}", headers={"Retry-After": "5"})


async def _run(request: Request, name: str, batch: CommandBatch, who: TokenInfo) -> Any:
    """Start the batch and answer at once with its id (the `X-Tether-Batch` header, and the first SSE
    event); the results follow as one JSON body or as SSE. A caller that goes away before the end
    cancels the batch on the device, and the audit says so."""
    stamp_approvals(batch.commands, who, request, name)
    hub = _hub(request)
    refuse_unaudited(_store(request))
    if hub.remote is not None and not hub.holds(name) and (problem := hub.remote.problem()) is not None:
        raise HTTPException(503, f"{problem}; device '{name}' is not connected to this node, so nothing was sent",
                            headers={"Retry-After": "5"})
    session_id = owned_session(_store(request), name, batch.session_id, batch.commands, who)  # 403 if not the caller's
    stream = "text/event-stream" in request.headers.get("accept", "")
    queue: asyncio.Queue[Event] | None = asyncio.Queue(maxsize=10_000) if stream else None

    def on_event(event: Event) -> None:
        if queue is not None and not queue.full():
            queue.put_nowait(event)

    dispatcher = hub.dispatcher(name, session_id=session_id, agent_name=batch.agent_name,
                                process_name=batch.process_name, root_name=batch.root_name,
                                on_event=on_event if stream else None, requested_by=f"api:{who.name}",
                                asker=TokenRef.of(who))
    response_id = new_call_id()
    run = dispatcher.execute_commands(batch.commands, timeout=batch.timeout, early_exit=batch.early_exit,
                                      response_id=response_id)
    limit = hub.settings.max_response_bytes
    if queue is None:
        # headers now, the body when the batch ends: a streamed response, so that Starlette notices a
        # caller that disconnects meanwhile (and cancels the generator, which cancels the batch)
        return BatchResponse(run, name, limit, response_id)
    return StreamingResponse(_sse(run, queue, name, response_id, limit), media_type="text/event-stream",
                             headers={BATCH_HEADER: response_id, "Cache-Control": "no-cache",
                                      "X-Accel-Buffering": "no"})


def _results_body(device: str, results: list[Result], limit: int) -> bytes:
    """The JSON of a batch's results, at most about `limit` bytes: past it, the largest results are
    replaced by failures that say how large they were and how the command ended on the device."""
    # built without validating again: the results are `Result`s already (the device's, checked as they came)
    body = BatchResults.model_construct(device=device, results=results).model_dump_json().encode()
    if len(body) <= limit:
        return body
    results = list(results)
    total = len(body)
    sizes = sorted(((len(r.model_dump_json()), i) for i, r in enumerate(results)), reverse=True)
    for size, i in sizes:
        if total <= limit:
            break
        ran = results[i]
        results[i] = Result.failure(
            f"result too large for this response: {size} bytes, and the response limit is {limit} bytes "
            f"(max_response_bytes); the command's own outcome on the device was '{ran.status.value}' "
            f"(see the audit log); ask for less output, or fewer commands per batch", ran.call_id, ran.namespace,
            {"too_large": True, "bytes": size, "limit": limit, "status": ran.status.value})
        total -= size - len(results[i].model_dump_json())
    return BatchResults(device=device, results=results).model_dump_json().encode()


HEADERS_AFTER_S = 0.05  # a batch still running after this gets its headers (X-Tether-Batch) before its results


class BatchResponse:
    """A batch's JSON results: the headers (with `X-Tether-Batch`) within `HEADERS_AFTER_S`, the body when
    the batch ends — both at once when it ends sooner.

    The batch runs in the request's own task; a timer sends the headers of a batch still running at
    `HEADERS_AFTER_S`, and the caller's disconnect cancels the batch (with `CALLER_GONE` as the reason, on
    the device and in the audit): told by the server's HTTP protocol (`coalesce.ON_DISCONNECT`), or, under
    another ASGI server, by one task reading `receive` for the `http.disconnect`. What `StreamingResponse` did with an
    anyio task group per request (~8% of the server's CPU per command), and then a task for the batch
    and an `asyncio.wait` per request (~4%, bench/fleet_hotpath.py with py-spy), is one timer here."""

    media_type = "application/json"

    def __init__(self, run: Any, device: str, limit: int, response_id: str) -> None:
        self.status_code = 200
        # built as bytes directly: Starlette's `Response` (its headers a dict, encoded pair by pair) cost more
        self.raw_headers = [(b"content-type", b"application/json"), (b"x-tether-batch", response_id.encode()),
                            (b"cache-control", b"no-cache")]
        self._run, self._device, self._limit = run, device, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        assert me is not None
        early: asyncio.Task[None] | None = None  # the headers, sent while the batch still runs
        running, gone = True, False

        def headers_now() -> None:
            nonlocal early
            early = loop.create_task(send({"type": "http.response.start", "status": self.status_code,
                                           "headers": self.raw_headers}))

        def caller_gone() -> None:
            nonlocal gone
            if running:
                gone = True
                me.cancel(CALLER_GONE)  # the dispatcher cancels the batch on the device and audits why

        def caller_left(watch: asyncio.Task[None]) -> None:
            if not watch.cancelled() and watch.exception() is None:
                caller_gone()

        timer = loop.call_later(HEADERS_AFTER_S, headers_now)
        on_disconnect = scope.get(ON_DISCONNECT)  # our own HTTP protocol's hook (coalesce.py): no task
        if on_disconnect is not None:
            unwatch = on_disconnect(caller_gone)
        else:
            watch = loop.create_task(_disconnected(receive))
            watch.add_done_callback(caller_left)
            unwatch = watch.cancel
        try:
            results = await self._run
        except asyncio.CancelledError:
            if not gone:
                raise
            me.uncancel()  # our own cancellation, for the batch: the caller is gone, nobody to answer
            if early is not None:
                early.cancel()
            return
        finally:
            running = False
            timer.cancel()
            unwatch()
        body = _results_body(self._device, results, self._limit)
        if early is not None:
            await early
        else:  # answered whole (Content-Length): with the coalescing transport, one write
            self.raw_headers.append((b"content-length", str(len(body)).encode()))
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _stop_if_running(task: asyncio.Future[Any]) -> None:
    """The caller went away: cancel the dispatcher's task, which cancels the batch on the device (with
    `CALLER_GONE` as the reason its commands fail with) and writes the audit rows. The task does that
    itself, outside the response's cancelled scope, where its awaits are not cancelled again."""
    if not task.done():
        task.cancel(CALLER_GONE)


def _sse_frame(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, default=str)}\n\n".encode()


async def _sse(run: Any, queue: asyncio.Queue[Event], device: str, response_id: str,
               limit: int) -> AsyncIterator[bytes]:
    task = asyncio.ensure_future(run)
    getter: asyncio.Future[Event] | None = None
    try:
        yield _sse_frame("device", {"device": device, "batch": response_id})
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield _sse_frame("event", getter.result().model_dump(mode="json"))
                continue
            while not queue.empty():
                yield _sse_frame("event", queue.get_nowait().model_dump(mode="json"))
            results = task.result()
            yield b"event: results\ndata: " + _results_body(device, results, limit) + b"\n\n"
            return
    finally:
        if getter is not None:
            getter.cancel()
        _stop_if_running(task)


@router.delete("/batches/{response_id}")
async def cancel_batch(response_id: str, request: Request,
                       who: Annotated[TokenInfo, Depends(require("execute"))]) -> dict[str, Any]:
    hub = _hub(request)
    reason = f"cancelled by api:{who.name} (DELETE /api/v1/batches/{response_id})"
    if who.scoped:  # only a batch of a device it reaches, and one it can see here (not another node's)
        device = hub.batch_device(response_id)
        if device is None or not reaches(who, _registry(request), device):
            raise HTTPException(404, f"no batch '{response_id}' is running on a device in the scope of token "
                                     f"'{who.name}' ({who.scope_text()})")
    cancelled = await hub.cancel(response_id, reason)
    if not cancelled and hub.remote is not None and not who.scoped:  # a batch another node started
        cancelled = await hub.remote.cancel(response_id, reason)
    if not cancelled:
        raise HTTPException(404, f"no batch '{response_id}' is running")
    return {"cancelled": response_id}


class QuestionAnswer(BaseModel):
    """A person's answer to the question an external MCP server asked while a command ran (an
    `elicitation` event of the command's stream, whose `id` names it)."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["accept", "decline", "cancel"]
    content: dict[str, str | int | float | bool | list[str] | None] | None = Field(None, max_length=100)


@router.post("/devices/{name}/questions/{question}")
async def answer_question(name: str, question: str, body: QuestionAnswer, request: Request,
                          who: Annotated[TokenInfo, Depends(require("approve"))]) -> dict[str, Any]:
    """Answer an MCP server's question. The `approve` scope, not `execute`: an answer lets a tool go on
    in a way a person chose (often a yes to something it is about to do), as an approval does, so a
    token that may only run commands (an agent's) cannot answer the questions meant for a person.

    The question is its command's caller's (`approvals.check_answerer`): a person answers the questions of
    their own commands; those of an agent's command go to a person holding `approve` for the device; with
    four-eyes on, one that asks for consent needs a person other than the caller. Any other token: 403."""
    hub = _hub(request)
    _record(_registry(request), name, who)  # a question of a device outside the token's scope is not there for it
    question = question[:64]
    require_approver(who, f"answer question '{question}' of device '{name}'",
                     how_a_person_approves(str(request.base_url), device=name, question=question))
    try:
        sent = await hub.answer_question(name, question, body.action, body.content, by=f"api:{who.name}",
                                         answerer=TokenRef(who.name, who.agent))
    except ApprovalRefused as exc:
        raise HTTPException(exc.status, str(exc)) from None
    except LookupError as exc:
        raise HTTPException(409, str(exc)) from None
    if not sent:
        raise HTTPException(404, f"no question '{question}' of device '{name}' is waiting for an answer")
    return {"answered": question, "action": body.action}


def require_fleet(scope: str):
    """A dependency that admits an API token holding `scope` and reaching every device: what acts on the
    whole fleet's keys (tokens) must not be open to a token scoped to some devices, which could otherwise
    make itself an unscoped one."""

    async def check(request: Request, authorization: Annotated[str | None, Header()] = None) -> TokenInfo:
        who = authorize(request, authorization, scope)
        if who.scoped:
            raise HTTPException(403, f"token '{who.name}' is scoped to some devices ({who.scope_text()}); "
                                     "this needs a token that reaches every device")
        return who

    return check


@router.get("/tokens")
async def list_tokens(request: Request,
                      _: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> list[dict[str, Any]]:
    return [_token_dict(t) for t in _store(request).tokens.all()]


@router.post("/tokens", response_model=TokenCreated, status_code=201)
async def create_token(body: TokenRequest, request: Request,
                       _: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> TokenCreated:
    """Create a token (its secret is in the answer only). A device token may carry the device's
    `public_key`, enrolled with it (`device_keys.parse_public_key` reads it; 400 when malformed, 409 when
    the device has another key already): from then on only a registration proving that key is accepted."""
    store = _store(request)
    key: str | None = None
    if body.public_key is not None:
        if body.kind != "device":
            raise HTTPException(400, "public_key is a device's key: give it with kind 'device'")
        try:
            key = parse_public_key(body.public_key)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        enrolled = device_key(store, body.name)
        if enrolled is not None and enrolled.public_key != key:
            raise HTTPException(409, f"device '{body.name}' has another key (enrolled by {enrolled.enrolled_by}); "
                                     f"to give it a new key use: tether token rotate --device {body.name} "
                                     "--key PUBLIC_KEY")
    try:
        info, secret = store.tokens.create(body.kind, body.name, body.scopes, devices=body.devices,
                                           tags=body.tags, agent=body.agent)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None
    if key is not None and device_key(store, body.name) is None:
        set_device_key(store, body.name, key, "admin")
    info_dict = _token_dict(info)
    if body.kind == "device":
        enrolled = device_key(store, body.name)
        info_dict["key_fingerprint"] = fingerprint(enrolled.public_key) if enrolled is not None else None
    return TokenCreated(token=secret, info=info_dict)


@router.delete("/tokens/{token}")
async def revoke_token(token: str, request: Request,
                       _: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> dict[str, Any]:
    count = _hub(request).revoke_token(token)  # also drops a connected device at once
    if not count:
        raise HTTPException(404, f"no active token '{token}'")
    return {"revoked": count}


@router.get("/audit")
async def audit(request: Request, who: Annotated[TokenInfo, Depends(require("admin"))], limit: int = 100,
                device: str | None = None, task: str | None = None, token: str | None = None,
                since: float | None = None, until: float | None = None,
                before: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None) -> dict[str, Any]:
    """Audit rows newest first, filtered server-side; `next` is the `before` of the following page
    (null on the last one). `token` is an API token's name, `task` an id or prefix, times unix seconds."""
    limit = max(1, min(limit, 500))
    devices = None
    if who.scoped:  # a scoped admin reads the rows of the devices it reaches, and no others
        if device is not None:
            in_scope(_registry(request), who, device)
        devices = reached_names(who, _hub(request).registry) or []
    rows = _store(request).audit.rows(limit=limit + 1, device=device, task=task, token=token, since=since,
                                      until=until, before=before, devices=devices)
    more = len(rows) > limit
    rows = rows[:limit]
    return {"rows": rows, "next": rows[-1]["id"] if more else None}


def _token_dict(info: TokenInfo) -> dict[str, Any]:
    return info.model_dump(mode="json") if hasattr(info, "model_dump") else dict(vars(info))
