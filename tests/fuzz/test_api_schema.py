"""schemathesis against the server's own OpenAPI document (/openapi.json), with real tokens.

A real agent server (REST, tasks, /aip) on 127.0.0.1 with a scripted device `alpha` online, so
that the command and tool routes reach a device when the generated name is `alpha` (a hook swaps it
in for half the cases). Every generated request (valid and invalid data) must get no 5xx, an error
body of exactly `{"error": "<text>"}` for every 4xx, and a response that conforms to the document
(status code, content type, headers, body schema), as schemathesis's checks judge it. Undocumented
methods (405) and unknown paths (404) must answer `{"error": …}` too.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import requests
import schemathesis
from hypothesis import given
from hypothesis import strategies as st
from websockets.asyncio.client import connect

from tests.kits.aip import registration
from tests.kits.fuzz import WAIT, LiveServer, fuzz_settings
from tether.agent.server_app import create_agent_app
from tether.protocol.codec import decode_server_message, encode
from tether.protocol.messages import ClientMessage, ClientMessageType, ServerMessageType, TaskStatus
from tether.protocol.models import Result, ResultStatus
from tether.server.settings import ServerSettings
from tether.server.store import Store

DEVICE = "alpha"


async def scripted_device(server: LiveServer, registered: asyncio.Event) -> None:
    """Device `alpha`: registers, answers heartbeats' absence with nothing, and every command with
    a success that echoes it. Runs on the server's loop until cancelled."""
    headers = server.auth(server.device_tokens[DEVICE])
    async with connect(server.aip, additional_headers=headers, ping_interval=None, max_size=None) as ws:
        await ws.send(encode(ClientMessage(type=ClientMessageType.REGISTER, payload=registration(
            ws, DEVICE, "schema-fuzz").model_dump())))
        ack = decode_server_message(await ws.recv(), 1 << 30)
        assert ack.type is ServerMessageType.REGISTER_ACK, ack
        registered.set()
        async for raw in ws:
            msg = decode_server_message(raw, 1 << 30)
            if msg.type is ServerMessageType.COMMAND:
                await ws.send(encode(ClientMessage(
                    type=ClientMessageType.COMMAND_RESULTS, prev_response_id=msg.response_id,
                    status=TaskStatus.COMPLETED, action_results=[
                        Result(status=ResultStatus.SUCCESS, result={"tool": c.tool_name}, call_id=c.call_id)
                        for c in msg.actions or []])))
            elif msg.type in (ServerMessageType.POLICY_REQUEST, ServerMessageType.POLICY_SET):
                await ws.send(encode(ClientMessage(
                    type=ClientMessageType.POLICY_REPORT, prev_response_id=msg.response_id,
                    payload={"version": 0, "policy": {}, "sources": {}, "remote_allowed": True})))


@pytest.fixture(scope="module")
def device_online(live_server: LiveServer):
    registered = asyncio.Event()
    future = live_server.spawn(scripted_device(live_server, registered))

    async def wait_registered() -> None:
        async with asyncio.timeout(WAIT):
            await registered.wait()

    live_server.call(wait_registered())
    yield live_server
    future.cancel()


def _with_device(context: Any, path_parameters: dict[str, Any] | None) -> Any:
    """Half of the cases address the online device by name (the rest keep the generated name); removing a
    device (DELETE /api/v1/devices/{name}) keeps the generated one, so the online device stays for the rest."""
    if not path_parameters or "name" not in path_parameters:
        return st.just(path_parameters)
    operation = getattr(context, "operation", None)
    if operation is not None and operation.method.upper() == "DELETE" and operation.path == "/api/v1/devices/{name}":
        return st.just(path_parameters)
    return st.sampled_from([path_parameters, {**path_parameters, "name": DEVICE}])


def own_document() -> dict[str, Any]:
    """The document the server serves at /openapi.json, built the same way without a server (the
    parametrization happens at collection); `test_the_served_document_is_the_one_fuzzed` checks
    that the live server serves exactly this one."""
    store = Store(":memory:")
    try:
        return create_agent_app(ServerSettings(db_path=":memory:"), store).openapi()
    finally:
        store.close()


DOCUMENT = own_document()
schema = schemathesis.openapi.from_dict(DOCUMENT)
schema.hook("flatmap_path_parameters")(_with_device)


def assert_error_body(response: Any) -> None:
    """A 4xx or 5xx body is exactly `{"error": "<text>"}` (the API's one error shape)."""
    if response.status_code < 400:
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code} with a body that is not JSON: {response.content[:200]!r}") \
            from None
    assert isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str) and body["error"], \
        f"{response.status_code} answered {body!r}, not {{'error': ...}}"


@schema.parametrize()
@fuzz_settings(scale=0.5)
def test_every_operation_conforms_and_errors_are_error_bodies(case: Any, device_online: LiveServer) -> None:
    session = requests.Session()
    session.trust_env = False
    response = case.call(base_url=device_online.base, session=session, headers=device_online.auth(), timeout=WAIT)
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    assert_error_body(response)
    # not `negative_data_rejection`: the API validates in pydantic's lax mode on purpose (0 for false,
    # "5" for 5), which that check counts as accepting invalid data
    case.validate_response(response, excluded_checks=[schemathesis.checks.negative_data_rejection])
    assert device_online.alive
    assert not (errors := device_online.errors.take()), "\n".join(errors)


@given(path=st.text(alphabet=st.characters(codec="ascii", exclude_categories=["Cc"]), max_size=40),
       method=st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE"]))
@fuzz_settings(scale=1)
def test_unknown_paths_and_methods_answer_error_bodies(device_online: LiveServer, path: str, method: str) -> None:
    """Anything off the document: 404 or 405 (or a 4xx the route gives) with `{"error": …}`, never 5xx."""
    url = device_online.base + "/" + quote(path.lstrip("/"), safe="/?=&")
    with httpx.Client(timeout=WAIT, trust_env=False) as http:
        response = http.request(method, url, headers=device_online.auth())
    assert response.status_code < 500, (method, path, response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert_error_body(response)
    assert not (errors := device_online.errors.take()), "\n".join(errors)


def test_the_served_document_is_the_one_fuzzed(device_online: LiveServer) -> None:
    with httpx.Client(base_url=device_online.base, timeout=WAIT, trust_env=False) as http:
        document = http.get("/openapi.json").json()
    assert document == DOCUMENT
    assert {"/api/v1/devices/{name}/commands", "/api/v1/tasks", "/api/v1/tokens"} <= set(document["paths"])
