"""Running commands: `POST /api/v1/devices/{name}/commands` (one device) and `POST /api/v1/commands` (the
least-loaded device that fits), their results as one answer or as server-sent events, `DELETE
/api/v1/batches/{id}` (cancel one running), and the answer to a question an external MCP server asked while a
command ran.

The two command routes are answered ahead of FastAPI's stack (front.py `FastRoutes`); FastAPI
documents them from the signature `command_route` gives them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from inspect import Parameter, Signature
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from tether.protocol.messages import Event
from tether.protocol.models import Command, Result, new_call_id
from tether.protocol.profile import DeviceRequirements
from tether.server.aip.batches.ledger import TokenRef
from tether.server.aip.fleet.matching import NoDeviceError
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.fleet.scopes import beyond, reaches, within
from tether.server.http import internals
from tether.server.http.api import (
    ERROR_RESPONSES,
    _hub,
    _reachable,
    _record,
    _registry,
    _store,
    authorize,
    refuse_unaudited,
    require,
    require_approver,
    stamp_approvals,
)
from tether.server.http.coalesce import ON_DISCONNECT
from tether.server.http.front import FastRoute
from tether.server.http.json_errors import error_message
from tether.server.http.request_guard import receive_body
from tether.server.store.tokens import TokenInfo
from tether.server.trust.approvals import ApprovalRefused, how_a_person_approves
from tether.server.trust.sessions import owned_session

router = APIRouter(prefix="/api/v1", responses=ERROR_RESPONSES)


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
        problems = "; ".join(f"{'.'.join(str(p) for p in ('body', *e['loc']))}: {error_message(e)}"
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
    who = await authorize(request, request.headers.get("authorization"), "execute")
    batch = await _fast_batch(CommandBatch, body)
    name = request.path_params["name"]
    await _reachable(_hub(request), _registry(request), name, who)
    return await _run(request, name, batch, who)


@command_route("/commands", SelectedBatch, on_device=False)
async def run_selected(request: Request) -> Any:
    """Run a batch on the least-loaded online device that meets `requires`."""
    body = await read_body(request)  # first, as FastAPI does: an oversized body is a 413 before anything else
    who = await authorize(request, request.headers.get("authorization"), "execute")
    batch = await _fast_batch(SelectedBatch, body)
    assert isinstance(batch, SelectedBatch)
    return await _run(request, _select(_registry(request), batch.requires, who), batch, who)


BATCH_HEADER = "X-Tether-Batch"  # the batch's id, sent before any result: DELETE /api/v1/batches/{id}
HOLDER_HEADER = "X-Tether-Holder"  # in a cluster: the API URL of the node holding the device, when not this one
CALLER_GONE = "cancelled: the HTTP caller disconnected before the batch finished"


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
    # 403 if not the caller's
    session_id = await owned_session(_store(request), name, batch.session_id, batch.commands, who)
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
    holder = hub.remote.hint(name) if hub.remote is not None and not hub.holds(name) else None  # docs/scaling.md
    if queue is None:
        # headers now, the body when the batch ends: a streamed response, so that Starlette notices a
        # caller that disconnects meanwhile (and cancels the generator, which cancels the batch)
        return BatchResponse(run, name, limit, response_id, holder)
    return StreamingResponse(_sse(run, queue, name, response_id, limit), media_type="text/event-stream",
                             headers={BATCH_HEADER: response_id, "Cache-Control": "no-cache",
                                      "X-Accel-Buffering": "no", **({HOLDER_HEADER: holder} if holder else {})})


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


# A batch still running after this gets its headers (X-Tether-Batch) before its results, and its body then goes
# chunked. Long enough that an ordinary command on a busy server (tens of ms, at times hundreds) is answered
# whole, with a Content-Length; short enough that a caller of a long command learns its batch id (to cancel
# it, or look it up) within a second. A caller that wants the id at once asks for server-sent events.
HEADERS_AFTER_S = 1.0


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

    def __init__(self, run: Any, device: str, limit: int, response_id: str, holder: str | None = None) -> None:
        self.status_code = 200
        # built as bytes directly: Starlette's `Response` (its headers a dict, encoded pair by pair) cost more
        self.raw_headers = [(b"content-type", b"application/json"), (b"x-tether-batch", response_id.encode()),
                            (b"cache-control", b"no-cache")]
        if holder:
            self.raw_headers.append((b"x-tether-holder", holder.encode()))
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
