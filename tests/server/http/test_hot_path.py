"""The command hot path (issue 13): plain routes, cached token checks, audit outcomes by group commit.

The whole app (`create_app`) under a real uvicorn on 127.0.0.1, a scripted AIP device (aip_testkit) that
answers every command, and httpx as the REST caller. What must not change while the path got lean:
- a revoked token is refused on the very next request, whether this server revoked it (the REST API)
  or another writer of the database did (another connection, as `tether token revoke` is);
- the audit rows of N concurrent commands are all there with their outcome as soon as the callers have
  their answers — through the API and for a reader in another connection;
- the queue of audit rows written behind is drained when the server shuts down;
- the command routes keep their OpenAPI entries (the plain routes answer, the documented ones describe),
  and their errors are `{"error": …}` as before.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.kits.aip import WAIT, FakeDevice
from tether.server.http.app import create_app
from tether.server.settings import ServerSettings
from tether.server.store import Store

CHEAP = {"tool_name": "noop", "parameters": {"n": 1}}


class App:
    def __init__(self, store: Store, server: uvicorn.Server, task: asyncio.Task, port: int, db: Path) -> None:
        self.store, self.server, self.task, self.port, self.db = store, server, task, port, db
        self.url = f"http://127.0.0.1:{port}"
        self.admin = store.tokens.create("api", "admin", ["admin"])[1]
        self.runner_info, self.runner = store.tokens.create("api", "runner", ["execute"])

    def http(self, token: str | None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=WAIT * 2)

    async def device(self, name: str) -> tuple[FakeDevice, asyncio.Task]:
        dev = FakeDevice(f"ws://127.0.0.1:{self.port}/aip", self.store.tokens.create("device", name)[1], name=name)
        await dev.register()
        return dev, dev.serve_forever()

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 15)


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[App]:
    db = tmp_path / "server.db"
    settings = ServerSettings(db_path=db, heartbeat_interval=5.0, heartbeat_timeout=30.0)
    store = Store(db)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # requests wait in the backlog until the lifespan has started the hub
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings, store), lifespan="on", log_config=None,
                                           log_level="warning", ws_ping_interval=None))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    running = App(store, server, task, port, db)
    yield running
    if not task.done():
        await running.stop()


async def run(http: httpx.AsyncClient, device: str, **extra: Any) -> httpx.Response:
    return await http.post(f"/api/v1/devices/{device}/commands", json={"commands": [CHEAP], **extra})


async def test_a_token_revoked_through_the_api_is_refused_on_the_very_next_request(app: App) -> None:
    _, serving = await app.device("alpha")
    async with app.http(app.runner) as runner, app.http(app.admin) as admin:
        for _ in range(3):  # verified once, then answered from the cache
            answer = await run(runner, "alpha")
            assert answer.status_code == 200 and answer.json()["results"][0]["status"] == "success"
        assert (await admin.delete(f"/api/v1/tokens/{app.runner_info.id}")).status_code == 200
        refused = await run(runner, "alpha")
        assert refused.status_code == 401 and refused.json() == {"error": "unknown or revoked token"}
        selected = await runner.post("/api/v1/commands", json={"commands": [CHEAP]})
        assert selected.status_code == 401
    serving.cancel()


async def test_a_token_revoked_by_another_writer_of_the_database_is_refused_at_once(app: App) -> None:
    _, serving = await app.device("alpha")
    async with app.http(app.runner) as runner:
        assert (await run(runner, "alpha")).status_code == 200
        other = Store(app.db)  # another connection: `tether token revoke` on the same database
        try:
            assert other.tokens.revoke("runner") == 1
        finally:
            other.close()
        assert (await run(runner, "alpha")).status_code == 401
        assert (await runner.get("/api/v1/devices")).status_code == 401  # every route, not only commands
    serving.cancel()


async def test_the_audit_rows_of_concurrent_commands_are_all_there_when_the_callers_have_answers(app: App) -> None:
    servings = [(await app.device(name))[1] for name in ("alpha", "beta")]
    n = 40
    async with app.http(app.runner) as runner, app.http(app.admin) as admin:
        answers = await asyncio.gather(*(run(runner, ("alpha", "beta")[i % 2]) for i in range(n)))
        call_ids = set()
        for answer in answers:
            assert answer.status_code == 200, answer.text
            [result] = answer.json()["results"]
            assert result["status"] == "success"
            call_ids.add(result["call_id"])
        assert len(call_ids) == n
        # another connection sees every outcome already: the callers heard after the commit
        reader = Store(app.db)
        try:
            rows = reader.audit.rows(limit=10 * n)
        finally:
            reader.close()
        assert {r["call_id"]: r["status"] for r in rows} == dict.fromkeys(call_ids, "success")
        assert {r["requested_by"] for r in rows} == {"api:runner"}
        listed = (await admin.get("/api/v1/audit", params={"limit": 500})).json()["rows"]
        assert {r["call_id"] for r in listed if r["status"] == "success"} == call_ids
    for serving in servings:
        serving.cancel()


async def test_shutdown_drains_the_audit_rows_written_behind(app: App) -> None:
    await app.device("alpha")
    async with app.http(app.runner) as runner:
        assert (await run(runner, "alpha")).status_code == 200
    # rows queued behind the request path (as a batch refused before sending is) and not yet flushed
    app.store.audit.record_soon([("api:runner", "alpha", f"queued-{i}", "noop", {}, "failure", "refused", None)
                                 for i in range(10)])
    assert app.store.audit.held == 10
    await app.stop()  # the lifespan's end closes the store, which writes them first
    reader = Store(app.db)
    try:
        queued = [r for r in reader.audit.rows(limit=1000) if (r["call_id"] or "").startswith("queued-")]
    finally:
        reader.close()
    assert sorted(r["call_id"] for r in queued) == sorted(f"queued-{i}" for i in range(10))


async def test_the_openapi_document_still_describes_the_command_routes(app: App) -> None:
    async with app.http(None) as anyone:
        document = (await anyone.get("/openapi.json")).json()
    for path, model in (("/api/v1/devices/{name}/commands", "CommandBatch"), ("/api/v1/commands", "SelectedBatch")):
        post = document["paths"][path]["post"]
        body = post["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith(f"/{model}")
        assert "BatchResults" in str(post["responses"]["200"])
        assert "text/event-stream" in post["responses"]["200"]["content"]
        assert "4XX" in post["responses"]
    assert "CommandBatch" in document["components"]["schemas"]


async def test_the_plain_command_routes_answer_errors_as_before(app: App) -> None:
    await app.device("alpha")
    async with app.http(None) as anyone, app.http(app.runner) as runner, app.http(app.admin) as admin:
        missing = await run(anyone, "alpha")
        assert missing.status_code == 401 and "missing bearer token" in missing.json()["error"]
        device_token = app.store.tokens.create("device", "gamma")[1]
        async with app.http(device_token) as device:
            assert (await run(device, "alpha")).status_code == 403
        reader = app.store.tokens.create("api", "reader", ["read"])[1]
        async with app.http(reader) as looker:
            lacks = await run(looker, "alpha")
            assert lacks.status_code == 403 and "lacks the 'execute' scope" in lacks.json()["error"]
        bad = await runner.post("/api/v1/devices/alpha/commands", json={"commands": []})
        assert bad.status_code == 422 and bad.json()["error"].startswith("invalid request: body.commands")
        extra = await runner.post("/api/v1/devices/alpha/commands", json={"commands": [CHEAP], "bogus": 1})
        assert extra.status_code == 422 and "body.bogus" in extra.json()["error"]
        garbage = await runner.post("/api/v1/devices/alpha/commands", content=b"{not json",
                                    headers={"Content-Type": "application/json"})
        assert garbage.status_code == 422 and garbage.json()["error"].startswith("invalid request")
        # JSON syntax, but no Unicode text: said for what it is (not "unexpected end of hex escape"), where it is
        for raw, said in ((b'{"commands": [{"tool_name": "\\ud800"}]}', "lone surrogate escape"),
                          (b'{"commands": [{"tool_name": "\\udc00x"}]}', "lone surrogate escape"),
                          (b'{"commands": [{"tool_name": "\xed\xa0\x80"}]}', "not valid UTF-8 text")):
            lone = await runner.post("/api/v1/devices/alpha/commands", content=raw,
                                     headers={"Content-Type": "application/json"})
            error = lone.json()["error"]
            assert lone.status_code == 422 and said in error and "at line 1 column" in error, error
            assert "hex escape" not in error and "code point" not in error, error
        token = await admin.post("/api/v1/tokens", content=b'{"kind": "api", "name": "\\ud800"}',
                                 headers={"Content-Type": "application/json"})
        assert token.status_code == 422, token.text
        assert token.json()["error"].startswith("invalid request: body.name: not valid Unicode text: it holds a "
                                                "lone surrogate"), token.text
        unknown = await run(runner, "nobody")
        assert unknown.status_code == 404 and unknown.json() == {"error": "no device named 'nobody'"}
        nothing = await runner.post("/api/v1/commands", json={"commands": [CHEAP], "requires": {"tags": ["none"]}})
        assert nothing.status_code == 409 and "error" in nothing.json()
        wrong = await runner.get("/api/v1/commands")
        assert wrong.status_code == 405 and "POST" in wrong.headers["allow"]
        assert (await admin.get("/api/v1/health")).json()["status"] == "ok"


async def test_behind_a_path_prefix_the_fast_routes_still_answer(tmp_path: Path) -> None:
    """uvicorn's `root_path` (a proxy serving tether under /tether) puts the prefix in front of every path;
    the hot routes — a command POST and the AIP socket — are matched on what follows it, as Starlette's
    routing matches the others."""
    db = tmp_path / "server.db"
    store = Store(db)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(ServerSettings(db_path=db), store), lifespan="on",
                                           log_config=None, log_level="warning", ws_ping_interval=None,
                                           root_path="/tether"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    running = App(store, server, task, port, db)
    try:
        dev, serving = await running.device("alpha")  # the AIP socket, reached through the prefix
        async with running.http(running.runner) as runner:
            answer = await run(runner, "alpha")
            assert answer.status_code == 200 and answer.json()["results"][0]["status"] == "success"
            assert (await run(runner, "nobody")).json() == {"error": "no device named 'nobody'"}
            assert (await runner.get("/api/v1/health")).status_code == 200
        serving.cancel()
        await dev.close()
    finally:
        await running.stop()


def test_the_listen_queue_is_deep_enough_for_a_reconnect_storm(tmp_path: Path) -> None:
    """uvicorn's default backlog (2048) filled in a 10,000-device storm: a dropped handshake is retried by
    the client after 1, 2, 4 s, and a command's connection timed out (bench/fleet_storm.py)."""
    from tether.server.main import build_config

    assert build_config(ServerSettings(db_path=tmp_path / "a.db")).backlog == 4096
    assert build_config(ServerSettings(db_path=tmp_path / "b.db", listen_backlog=100)).backlog == 100
