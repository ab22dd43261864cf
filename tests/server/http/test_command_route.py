"""The REST command routes are one implementation each: the function the app's fast path answers with is the one
FastAPI's router holds (and documents), and the OpenAPI document describes it as before — the path's device
name, the bearer token's header, the JSON body, and `BatchResults` or server-sent events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tether.server.http.app import create_app
from tether.server.http.front import FastRoute
from tether.server.http.routes import commands
from tether.server.settings import ServerSettings

ROUTES = {"/api/v1/devices/{name}/commands": (commands.run_commands, "CommandBatch", ["name", "authorization"]),
          "/api/v1/commands": (commands.run_selected, "SelectedBatch", ["authorization"])}


@pytest.fixture
def app(tmp_path: Path) -> Any:
    return create_app(ServerSettings(db_path=tmp_path / "server.db"))


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_the_documented_route_is_the_fast_one(path: str) -> None:
    handler, _, _ = ROUTES[path]
    [route] = [r for r in commands.router.routes if getattr(r, "path", None) == path]
    assert isinstance(route, FastRoute)
    assert route.endpoint is handler
    assert route.methods == {"POST"}


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_the_openapi_document_describes_it(app: Any, path: str) -> None:
    _, body, parameters = ROUTES[path]
    operation = app.openapi()["paths"][path]["post"]
    assert [p["name"] for p in operation["parameters"]] == parameters
    assert operation["requestBody"] == {"content": {"application/json": {"schema": {
        "$ref": f"#/components/schemas/{body}"}}}, "required": True}
    assert operation["responses"]["200"]["content"] == {
        "application/json": {"schema": {"$ref": "#/components/schemas/BatchResults"}}, "text/event-stream": {}}
    assert operation["responses"]["4XX"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorBody"}
