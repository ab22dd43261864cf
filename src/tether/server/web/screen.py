"""The live view: a device's screen in the dashboard, the agent's desktop actions drawn on it, and a
person taking over the desktop and handing it back (docs/desktop.md, "Live view").

- `GET /web/devices/{name}/screen`: server-sent events. `hello` (this view's `stream` id and who holds the
  desktop), `frame` for each screenshot taken (`png`, base64, only when the picture changed; `seq`, `shots`),
  `action` / `result` for each desktop action sent to the device by anyone (coordinates, element bounds,
  `via`), `hold` when the desktop is taken or handed back, `problem` when a screenshot failed.
- `POST .../screen/take`, `.../screen/release`, `.../screen/act`: take over (a person's token only),
  hand back, and act as the holder (a click, key, scroll or typed text: a desktop tool call audited
  as that person).

Seeing a screen takes the `execute` scope on a device the token reaches: a screen shows what a
screenshot would, and a `read` token may not take one. Every viewing session is one audit row when it
opens (`screen.view`) and one when it ends (`screen.view_end`, with the frames it was sent); taking
over and handing back are audited too. Each screenshot itself is not audited (several a second).
A hold ends with its view: when the page goes away, its stream ends and the hold is released; a page
that stops saying it is there (`.../screen/keep`, every 5 s) loses the hold after `HOLD_IDLE_S`.

In a cluster a view may be opened on any node: the hold lives on the node holding the device, with a
`HOLD_TTL_S` of its own there, and that node's desktop events are relayed to the view (web/screen_nodes.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tether.protocol.messages import ServerMessage, ServerMessageType
from tether.protocol.models import Command, new_call_id
from tether.server.aip.batches.ledger import TokenRef
from tether.server.aip.desktop_holds import DesktopHeld
from tether.server.http.api import require
from tether.server.store.tokens import TokenInfo
from tether.server.web.logins import COOKIE
from tether.server.web.screen_nodes import ScreenNodes

MIN_INTERVAL_S = 0.2  # at most 5 screenshots a second per view: each costs the device a grab and a PNG
RETRY_S = 2.0  # after a failed screenshot (the device away, no display)
SHOT_TIMEOUT_S = 15.0
KEEPALIVE_S = 15.0
# a holding page says it is still there at least this often (screen.js: every 5 s); past it the hold ends, so a
# page whose connection died without a word (no TCP reset) does not keep the desktop for the TCP timeout
HOLD_IDLE_S = 20.0
# where the device is, a hold not kept for this long ends by itself: the view's node died, or lost its way there
HOLD_TTL_S = HOLD_IDLE_S + 10.0
WATCH_RENEW_S = 5.0  # how often a view asks the device's node again to relay its desktop events here
PERSON_TOOLS = frozenset({"click", "press_key", "scroll", "type_text"})

screen_router = APIRouter(include_in_schema=False)


@dataclass
class View:
    """One open live view: its web session, its token's name, its device and the key of its hold, if any."""

    sid: str | None
    token: str
    device: str
    hold: str | None = None
    hold_at: str = ""  # the node holding the device when the hold was taken ("" for this one)
    seen: float = field(default_factory=time.monotonic)  # when the page last spoke (took, acted, kept)
    tell: Callable[[dict[str, Any]], None] | None = None  # an event for this view's page alone


@dataclass
class LiveViews:
    """The live views open on this node, by stream id."""

    views: dict[str, View] = field(default_factory=dict)


class HoldBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stream: str = Field(..., min_length=1, max_length=64)


class ActBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stream: str = Field(..., min_length=1, max_length=64)
    tool: str = Field(..., min_length=1, max_length=32)
    parameters: dict[str, Any] = Field(default_factory=dict)


def _reach(request: Request, who: TokenInfo, device: str) -> None:
    record = request.app.state.hub.registry.get(device)
    if record is None or not who.reaches(device, record.tags):
        raise HTTPException(404, f"no device named '{device[:200]}'")


def _view(request: Request, who: TokenInfo, device: str, stream: str) -> View:
    view = request.app.state.live_views.views.get(stream)
    if view is None or view.device != device or view.token != who.name or view.sid != request.cookies.get(COOKIE):
        raise HTTPException(404, "no such live view open on this page (reload it)")
    return view


def _audit(request: Request, who: str, device: str, what: str, parameters: dict[str, Any]) -> None:
    request.app.state.store.audit.record_soon(
        [(f"api:{who}", device, new_call_id(), what, parameters, "success", None, None, None, None)])


def _event(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, default=str)}\n\n".encode()


@screen_router.get("/web/devices/{name}/screen")
async def screen_stream(name: str, request: Request,
                        who: Annotated[TokenInfo, Depends(require("execute"))]) -> StreamingResponse:
    """The live view's event stream (see the module's docstring); 404 for a device the token does not reach."""
    _reach(request, who, name)
    return StreamingResponse(_stream(request, who, name), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _shoot(request: Request, device: str) -> dict[str, Any]:
    """One screenshot of `device` (keeping no frame there); a ToolError-like message in `error` on failure."""
    hub = request.app.state.hub
    call_id = new_call_id()
    message = ServerMessage(type=ServerMessageType.COMMAND, response_id=new_call_id(), timeout=SHOT_TIMEOUT_S,
                            actions=[Command(tool_name="screenshot", parameters={"keepFrame": False},
                                             call_id=call_id, tool_type="data_collection")])
    batch = await hub.send_batch(device, message)
    try:
        async with asyncio.timeout(SHOT_TIMEOUT_S):
            await batch.done.wait()
    except TimeoutError:
        await hub.cancel(message.response_id, "the live view's screenshot timed out")
        return {"error": f"no screenshot within {SHOT_TIMEOUT_S:g}s"}
    result = batch.results.get(call_id)
    if result is None or not result.ok or not isinstance(result.result, dict):
        return {"error": (result.error if result is not None else batch.error) or "no screenshot"}
    return result.result


async def _stream(request: Request, who: TokenInfo, device: str) -> AsyncIterator[bytes]:
    hub = request.app.state.hub
    views: LiveViews = request.app.state.live_views
    nodes: ScreenNodes = request.app.state.screen_nodes
    stream = secrets.token_urlsafe(12)
    view = views.views[stream] = View(request.cookies.get(COOKIE), who.name, device)
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=256)

    def told(event: dict[str, Any]) -> None:
        if not queue.full():  # a view that cannot keep up loses marks, never blocks the router
            queue.put_nowait((str(event.get("kind")), event))

    view.tell = told

    async def watch() -> str | None:
        try:
            return await nodes.watch(device)
        except HTTPException as exc:
            told({"kind": "problem", "error": str(exc.detail)})
            return None

    async def follow() -> None:
        """The device's connection moved to another node (its node died, or it reconnected elsewhere): the
        hold follows it there, since the old node's hold no longer stands in anyone's way."""
        try:
            at = await nodes.located(device)
        except HTTPException:
            return
        if at is None or at == view.hold_at or view.hold is None:
            return
        old, was = view.hold, view.hold_at
        try:
            view.hold, _, view.hold_at = await nodes.take(device, who.name, HOLD_TTL_S)
        except DesktopHeld as exc:
            view.hold = None
            told({"kind": "hold", "holder": exc.holder, "lost": True})
            return
        except HTTPException:
            return  # tried again with the next picture
        _audit(request, who.name, device, "screen.take", {"stream": stream, "why": f"the device moved to node "
                                                          f"{view.hold_at or 'serving this view'}"})
        nodes.release_soon(was, device, old, lambda released: None)  # else it runs out there (HOLD_TTL_S)

    async def rewatch() -> None:  # apart from the pictures: a dead node's silence must not hold them up
        while True:
            await asyncio.sleep(WATCH_RENEW_S)  # a renewal's period, not a wait for an event
            await watch()

    async def shots() -> None:
        seq, last = 0, b""
        while True:
            started = time.monotonic()
            if view.hold is not None:
                await follow()
            if view.hold is not None and started - view.seen > HOLD_IDLE_S:
                key, view.hold = view.hold, None
                try:
                    released = await nodes.release_at(view.hold_at, device, key)
                except HTTPException:  # its node does not answer: the hold runs out there (HOLD_TTL_S)
                    released = False
                if released:
                    _audit(request, who.name, device, "screen.hand_back",
                           {"stream": stream, "why": f"no word from the page for {HOLD_IDLE_S:g}s"})
            shot = await _shoot(request, device)
            if "error" in shot:
                await queue.put(("problem", {"error": str(shot["error"])[:500]}))
                await asyncio.sleep(RETRY_S)
                continue
            seq += 1
            digest = hashlib.blake2b(shot.get("data", "").encode(), digest_size=16).digest()
            frame = {"seq": seq, "width": shot.get("width"), "height": shot.get("height"), "screen": shot.get("screen")}
            if digest != last:
                frame["png"] = shot.get("data")
                last = digest
            await queue.put(("frame", frame))
            await asyncio.sleep(max(0.0, MIN_INTERVAL_S - (time.monotonic() - started)))

    remove = hub.desktop.watch(device, told)
    opened = time.monotonic()
    _audit(request, who.name, device, "screen.view", {"stream": stream})
    frames = 0
    producers: list[asyncio.Task[None]] = []
    try:
        holder = await watch()
        producers = [asyncio.create_task(shots(), name=f"live-view-{stream}"),
                     asyncio.create_task(rewatch(), name=f"live-view-watch-{stream}")]
        yield _event("hello", {"stream": stream, "device": device, "holder": holder, "you": who.name})
        while True:
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    kind, data = await queue.get()
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            frames += kind == "frame" and "png" in data
            yield _event(kind, data)
    finally:
        for producer in producers:
            producer.cancel()
        remove()
        views.views.pop(stream, None)
        if view.hold is not None:  # released off this (cancelled) path: the device may be on another node
            def handed_back(released: bool) -> None:
                if released:
                    _audit(request, who.name, device, "screen.hand_back",
                           {"stream": stream, "why": "the page went away"})

            nodes.release_soon(view.hold_at, device, view.hold, handed_back)
        _audit(request, who.name, device, "screen.view_end",
               {"stream": stream, "frames": frames, "seconds": round(time.monotonic() - opened, 1)})


@screen_router.post("/web/devices/{name}/screen/take")
async def take_over(name: str, body: HoldBody, request: Request,
                    who: Annotated[TokenInfo, Depends(require("execute"))]) -> dict[str, Any]:
    """Hold the device's desktop for this person: agents' desktop actions are refused until it is handed
    back or the view goes away. 403 for an agent's token, 409 when another person holds it."""
    _reach(request, who, name)
    if who.agent:
        raise HTTPException(403, f"token '{who.name}' is an agent's token: only a person takes over a desktop")
    view = _view(request, who, name, body.stream)
    try:
        key, since, at = await request.app.state.screen_nodes.take(name, who.name, HOLD_TTL_S)
    except DesktopHeld as exc:
        raise HTTPException(409, f"{exc}: they hand it back first") from None
    view.hold, view.hold_at, view.seen = key, at, time.monotonic()
    _audit(request, who.name, name, "screen.take", {"stream": body.stream})
    return {"holder": who.name, "since": since}


@screen_router.post("/web/devices/{name}/screen/keep")
async def keep(name: str, body: HoldBody, request: Request,
               who: Annotated[TokenInfo, Depends(require("execute"))]) -> dict[str, Any]:
    """The holding page is still there (sent every few seconds); `held` says whether it still holds."""
    view = _view(request, who, name, body.stream)
    view.seen = time.monotonic()
    nodes: ScreenNodes = request.app.state.screen_nodes
    # a device that moved to another node since: its hold follows it (the view's `follow`), not lost here
    if view.hold is not None and await nodes.located(name) == view.hold_at \
            and not await nodes.keep_at(view.hold_at, name, view.hold):
        view.hold = None  # it ran out where the device is
        if view.tell is not None:
            view.tell({"kind": "hold", "holder": None, "lost": True})
    return {"held": view.hold is not None}


@screen_router.post("/web/devices/{name}/screen/release")
async def hand_back(name: str, body: HoldBody, request: Request,
                    who: Annotated[TokenInfo, Depends(require("execute"))]) -> dict[str, Any]:
    """Hand the desktop back (agents may act again); `released` is False when this view held nothing."""
    view = _view(request, who, name, body.stream)
    key, view.hold = view.hold, None
    try:
        released = key is not None and await request.app.state.screen_nodes.release_at(view.hold_at, name, key)
    except HTTPException:  # its node is gone: so is the hold (it runs out there if that node lives)
        released = False
    if released:
        _audit(request, who.name, name, "screen.hand_back", {"stream": body.stream})
    return {"released": released}


@screen_router.post("/web/devices/{name}/screen/act")
async def act(name: str, body: ActBody, request: Request,
              who: Annotated[TokenInfo, Depends(require("execute"))]) -> dict[str, Any]:
    """The holder's click, key, scroll or typing, run as a desktop tool call audited as this person.
    409 when this view does not hold the desktop."""
    view = _view(request, who, name, body.stream)
    if body.tool not in PERSON_TOOLS:
        raise HTTPException(400, f"the live view sends {sorted(PERSON_TOOLS)}, not '{body.tool[:40]}'")
    # a hold on another node is checked there, against the key the batch carries
    if view.hold is None or (not view.hold_at and not request.app.state.hub.desktop.keep(name, view.hold)):
        raise HTTPException(409, "take over first: this view does not hold the desktop")
    view.seen = time.monotonic()
    dispatcher = request.app.state.hub.dispatcher(name, requested_by=f"api:{who.name}",
                                                  asker=TokenRef(who.name, False, hold=view.hold))
    [result] = await dispatcher.execute_commands([Command(tool_name=body.tool, parameters=body.parameters,
                                                          tool_type="action")], timeout=30)
    return {"result": result.model_dump(mode="json")}


def mount_screen(app: FastAPI) -> None:
    """Add the live view's routes; its open views live on `app.state.live_views`, its reach into a cluster on
    `app.state.screen_nodes` (started by the app's lifespan once the cluster node runs)."""
    app.state.live_views = LiveViews()
    app.state.screen_nodes = ScreenNodes(app.state.hub)
    app.include_router(screen_router)
