"""The dashboard's HTTP surface: the page, its assets, login/logout, the fleet stream, the API docs.

The stack is one static page with a small hand-written script (static/app.js) that calls the REST
API the CLI uses, with the session cookie instead of a bearer header. Why: no build step anywhere
(the file that runs is the file in git), nothing fetched at run time, no framework to keep up with,
and the server stays the only place rules live: the page shows what the session's scopes allow and
the API enforces them again. Live views use server-sent events: the task API's event stream (with
`?after=` to resume) and the fleet stream below, which sends a device row when it changes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tether.server.http.api import _view, require
from tether.server.store.tokens import TokenInfo
from tether.server.trust.oidc.bearer import OidcRefused
from tether.server.web.logins import COOKIE, WebSessions
from tether.server.web.screen import mount_screen

STATIC = Path(__file__).parent / "static"
KEEPALIVE_S = 15.0
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; "
                               "form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
# Swagger UI and ReDoc inject styles and (ReDoc) a worker from a blob: a looser policy for those two pages
DOCS_HEADERS = {**PAGE_HEADERS, "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                "img-src 'self' data:; worker-src 'self' blob:; frame-ancestors 'none'"}

web_router = APIRouter(include_in_schema=False)


class Login(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: str = Field(..., min_length=1, max_length=512)


class PlanText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(..., min_length=1, max_length=200_000)


def _sessions(request: Request) -> WebSessions:
    return request.app.state.web_sessions


def _me(info: TokenInfo, csrf: str) -> dict[str, Any]:
    # an agent's token holds no scope a person's approval needs, whatever its row says (store.AGENT_NEVER)
    return {"name": info.name, "scopes": sorted(s for s in info.scopes if info.allows(s)), "csrf": csrf,
            "agent": info.agent}


@web_router.get("/")
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)


@web_router.get("/web/static/{path:path}")
async def asset(path: str) -> FileResponse:
    """Packaged files only: the resolved path must stay inside static/ (no `..`, no symlinks out, no NUL); else
    404 `{"error": …}`."""
    if "\0" in path:  # no file has it in its name (resolve() would raise: a 500 anyone could ask for)
        raise HTTPException(404, f"no asset {path[:200]!r}")
    target = (STATIC / path).resolve()
    if not target.is_relative_to(STATIC.resolve()) or not target.is_file():
        raise HTTPException(404, f"no asset '{path[:200]}'")
    return FileResponse(target, headers={"Cache-Control": "public, max-age=300", "X-Content-Type-Options": "nosniff"})


@web_router.post("/web/login")
async def login(body: Login, request: Request) -> JSONResponse:
    """Exchange an API token for a session cookie. JSON only: a cross-site HTML form cannot send it
    without a preflight, and the request guard refuses foreign origins anyway."""
    secret = body.token.strip()
    try:  # one of tether's API tokens, or a configured OIDC issuer's JWT (docs/oidc.md: until it expires)
        info = await request.app.state.bearer.check(secret, request.scope)
    except OidcRefused as exc:
        raise HTTPException(exc.status, str(exc)) from None
    if info is None or info.kind != "api":
        raise HTTPException(401, "unknown, revoked or non-API token")
    sid, session = _sessions(request).open(secret)
    response = JSONResponse(_me(info, session.csrf))
    response.set_cookie(COOKIE, sid, httponly=True, samesite="strict", path="/",
                        secure=request.url.scheme == "https", max_age=int(_sessions(request).ttl))
    return response


@web_router.get("/web/session")
async def session_info(request: Request) -> dict[str, Any]:
    session = _sessions(request).get(request.cookies.get(COOKIE))
    try:
        info = await request.app.state.bearer.check(session.secret, request.scope) if session else None
    except OidcRefused:  # an OIDC token that expired since the login: logged out
        info = None
    if session is None or info is None:  # a 200: the page asks this on every load, and a 401 is a console error
        return {"name": None, "scopes": [], "csrf": None}
    return _me(info, session.csrf)


@web_router.post("/web/logout")
async def logout(request: Request) -> JSONResponse:
    """Whatever the token's scopes; the CSRF token is still required (a foreign page must not log you out)."""
    if _sessions(request).bearer_for(request) is None:
        raise HTTPException(401, "not logged in")
    _sessions(request).close(request.cookies.get(COOKIE))
    response = JSONResponse({"logged_out": True})
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return response


@web_router.post("/web/plan")
async def parse_plan(body: PlanText, _: Annotated[TokenInfo, Depends(require("read"))]) -> dict[str, Any]:
    """A plan pasted as YAML or JSON (YAML is a superset), as the steps list the task API takes: the
    page ships no YAML parser. Either a list of steps or `{steps: [...]}`."""
    import yaml

    from tether import yaml12

    try:
        data = yaml12.safe_load(body.text)
    except yaml.YAMLError as exc:
        raise HTTPException(400, f"the plan is neither YAML nor JSON: {yaml12.where_and_why(exc)}") from None
    steps = data.get("steps") if isinstance(data, dict) else data
    if not isinstance(steps, list) or not steps or not all(isinstance(s, dict) for s in steps):
        raise HTTPException(400, "a plan is a list of steps (each {skill, args}) or {steps: [...]}")
    return {"plan": steps}


@web_router.get("/web/fleet")
async def fleet(request: Request, who: Annotated[TokenInfo, Depends(require("read"))],
                device: str | None = None) -> StreamingResponse:
    """Server-sent events: `devices` (every row) first, then `device` with each row that changed,
    woken by the registry's change signal (no polling); only the devices the token reaches. An admin reaching
    every device also gets `pairing` (`{"version"}`) whenever a pairing request arrives or is decided.
    `?device=NAME`: that device's row alone (a device's page), and no `pairing`."""
    return StreamingResponse(_fleet_stream(request, who, device), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _key(record: Any) -> tuple[Any, ...]:
    """What the row shows, cheaply: a row is rebuilt only when this changes (1,000 devices, one change)."""
    return (record.status, record.last_seen, record.load, record.running, record.queued, id(record.profile),
            getattr(record, "address", None))


async def _fleet_stream(request: Request, who: TokenInfo, device: str | None = None) -> AsyncIterator[bytes]:
    registry = request.app.state.registry
    fleet_admin = who.allows("admin") and not who.scoped and not who.agent  # as GET /api/v1/pairing needs
    book = getattr(request.app.state, "pairing", None) if fleet_admin and device is None else None
    pairing = book.version if book is not None else 0

    def rows() -> list[Any]:
        if device is None:
            return registry.list()
        one = registry.get(device)
        return [] if one is None else [one]

    records = [r for r in rows() if who.reaches(r.name, r.tags)]
    shown = {r.name: _key(r) for r in records}
    yield _frame("devices", [_view(r).model_dump(mode="json") for r in records])
    while True:
        woken = False

        def changed() -> bool:
            nonlocal woken  # the first check is before any wait: say no, so the call waits for a change
            first, woken = not woken, True
            return not first

        await registry.wait_until(changed, KEEPALIVE_S)
        sent = False
        for record in rows():
            if not who.reaches(record.name, record.tags):
                continue
            key = _key(record)
            if shown.get(record.name) != key:
                shown[record.name] = key
                yield _frame("device", _view(record).model_dump(mode="json"))
                sent = True
        if book is not None and book.version != pairing:
            pairing = book.version
            yield _frame("pairing", {"version": pairing})
            sent = True
        if not sent:
            yield b": keep-alive\n\n"


def _frame(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, default=str)}\n\n".encode()


_DOCS_PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">{head}</head>
<body><div id="ui"></div>{body}</body></html>"""


@web_router.get("/docs")
async def swagger_docs() -> HTMLResponse:
    return HTMLResponse(_DOCS_PAGE.format(
        title="tether API", head='<link rel="stylesheet" href="/web/static/vendor/swagger-ui/swagger-ui.css">',
        body='<script src="/web/static/vendor/swagger-ui/swagger-ui-bundle.js"></script>'
             '<script src="/web/static/docs.js"></script>'), headers=DOCS_HEADERS)


@web_router.get("/redoc")
async def redoc_docs() -> HTMLResponse:
    return HTMLResponse(_DOCS_PAGE.format(
        title="tether API", head="",
        body='<script src="/web/static/vendor/redoc/redoc.standalone.js"></script>'
             '<script src="/web/static/redoc.js"></script>'), headers=DOCS_HEADERS)


def _declare_bearer(app: FastAPI) -> None:
    """The OpenAPI document declares the bearer scheme, so the docs' "Authorize" button works."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer",
                           "description": "an API token (tether token create --api)"}}
            for operations in schema.get("paths", {}).values():  # those that take a token (not /health)
                for operation in operations.values():
                    if any(p.get("in") == "header" and p.get("name", "").lower() == "authorization"
                           for p in operation.get("parameters", [])):
                        operation["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def mount_web(app: FastAPI) -> None:
    """Add the dashboard to an app built with `docs_url=None, redoc_url=None`; the REST auth
    dependency finds the sessions on `app.state.web_sessions`."""
    app.state.web_sessions = WebSessions()
    app.include_router(web_router)
    mount_screen(app)  # the live view of a device's screen (web/screen.py)
    _declare_bearer(app)
