"""Issue 10's attack catalogue, the protocol classes the reference device-agent implementation had advisories
for, tried against a real `tether server` process with real device connections (real tokens over real
WebSockets): response hijack and result injection, role and identity spoofing, session reuse and stale
replay, cross-device reads, result squatting, device-info disclosure and name traversal. DNS rebinding is
in test_server_boundaries.py.

The attacking devices are scripted (`aip_testkit.FakeDevice`: they send exactly the frames an attacker
would); the device that runs real tools is tether's own `DeviceConnection` in front of a device built by
`build_device`. Each attack must be refused with a clear error (an answer, an ERROR frame, a close code or
a server log line) and, where a command was involved, leave an audit row that tells what really happened.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus

from tests.kits import db as dbkit
from tests.kits.aip import FakeDevice
from tests.kits.netutil import wait_for
from tests.kits.server_target import Target, error_of
from tether.device.config import parse_device_config
from tether.device.link.connection import DeviceConnection
from tether.device.local import build_device
from tether.protocol.messages import ClientMessage, ClientMessageType, ServerMessageType, TaskStatus
from tether.protocol.models import Result, ResultStatus
from tether.tools.policy.model import policy_from_mapping

CLOSE_BAD_REGISTRATION, CLOSE_WRONG_DEVICE, CLOSE_DUPLICATE = 4400, 4403, 4409


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    server = Target(tmp_path_factory.mktemp("protocol"))
    yield server
    server.close()


SECRETS: list[str] = []  # every token this module made: none may ever show up where it should not


def token(target: Target, kind: str, name: str, scopes: tuple[str, ...] = ()) -> str:
    made = target.http.post("/api/v1/tokens", headers=target.auth,
                            json={"kind": kind, "name": name, "scopes": list(scopes)})
    assert made.status_code == 201, made.text
    SECRETS.append(made.json()["token"])
    return made.json()["token"]


def fake(target: Target, name: str) -> FakeDevice:
    return FakeDevice(target.aip, token(target, "device", name), name=name)


def api(target: Target, secret: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"{target.base}/api/v1", headers={"Authorization": f"Bearer {secret}"},
                             timeout=30)


def audit(target: Target, device: str) -> list[dict[str, Any]]:
    answer = target.http.get("/api/v1/audit", params={"device": device, "limit": 500}, headers=target.auth)
    assert answer.status_code == 200, answer.text
    return answer.json()["rows"]


def log_lines(target: Target, *words: str) -> list[str]:
    return [line for line in target.log().splitlines() if all(w in line for w in words)]


def wait_log(target: Target, *words: str) -> list[str]:
    return wait_for(lambda: log_lines(target, *words), f"a server log line with {words}",  # type: ignore[return-value]
                    procs=(target.proc.popen,))


def run_body(*commands: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"commands": list(commands), "timeout": 20, **extra}


def said(text: str) -> Result:
    return Result(status=ResultStatus.SUCCESS, result={"said": text})


async def registered(device: FakeDevice) -> FakeDevice:
    ack = await device.register()
    assert ack.type is ServerMessageType.REGISTER_ACK, ack
    return device


@asynccontextmanager
async def real_device(target: Target, name: str, tmp: Path) -> AsyncIterator[Path]:
    """tether's own device client, jailed to `tmp/root`, connected with a device token; yields the root."""
    root = tmp / "root"
    root.mkdir()
    config = parse_device_config({"device": {"name": name, "builtin": ["files", "system"]}})
    policy = policy_from_mapping({"read_roots": [str(root)], "write_roots": [str(root)]}, where="test")
    device = build_device(config, policy=policy, state_dir=tmp / "state", client_id=name, sandbox=False)
    link = DeviceConnection(device.client, target.aip, token(target, "device", name), name=name)
    task = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(link.connected.wait(), 30)
        yield root
    finally:
        link.stop()
        await asyncio.wait_for(task, 30)
        await device.aclose()


# -- response hijack and result injection -----------------------------------------------------------

async def test_results_for_a_batch_sent_to_another_device_are_refused(target):
    victim, attacker = fake(target, "hj-victim"), fake(target, "hj-attacker")
    await registered(victim)
    await registered(attacker)
    async with api(target, token(target, "api", "hj-caller", ("execute",))) as caller:
        call = asyncio.create_task(caller.post("/devices/hj-victim/commands", json=run_body(
            {"tool_name": "read_report", "call_id": "report-1"})))
        command = await victim.expect(ServerMessageType.COMMAND)
        rid = command.response_id
        # the attacker knows the batch id and the call_id: it answers first, fails it, streams into it
        forged = Result(status=ResultStatus.SUCCESS, result={"said": "forged by hj-attacker"}, call_id="report-1")
        await attacker.results(rid, [forged])
        await attacker.send(ClientMessage(type=ClientMessageType.ERROR, prev_response_id=rid, error="abort it"))
        await attacker.sync()
        # the victim itself sends a result for a call_id nobody asked, then its real one
        await victim.results(rid, [Result(status=ResultStatus.SUCCESS, result={"said": "extra"}, call_id="x-1")],
                             status=TaskStatus.CONTINUE)
        await victim.results(rid, [Result(status=ResultStatus.SUCCESS, result={"said": "real"}, call_id="report-1")])
        answer = await call
    assert answer.status_code == 200, answer.text
    [result] = answer.json()["results"]
    assert result == {**result, "status": "success", "result": {"said": "real"}, "call_id": "report-1"}
    assert "forged" not in answer.text and "extra" not in answer.text
    assert wait_log(target, "refused results from device hj-attacker", rid, "no such batch was sent to it")
    assert wait_log(target, "ignored result from device hj-victim for call_id x-1", "not outstanding")
    [row] = [r for r in audit(target, "hj-victim") if r["call_id"] == "report-1"]
    assert row["status"] == "success" and row["response_id"] == rid and row["requested_by"] == "api:hj-caller"
    assert not audit(target, "hj-attacker")  # nothing ran there, nothing was accounted to it
    for device in (victim, attacker):
        await device.close()


async def test_a_caller_cannot_choose_the_batch_id(target):
    """The batch id is the key results are matched by: only the server issues it (random, 128 bits)."""
    device = await registered(fake(target, "bid-device"))
    serving = device.serve_forever()
    async with api(target, token(target, "api", "bid-caller", ("execute",))) as caller:
        chosen = await caller.post("/devices/bid-device/commands",
                                   json=run_body({"tool_name": "noop"}, response_id="0" * 32))
        assert chosen.status_code == 422 and "response_id" in error_of(chosen.content)
        ids = set()
        for _ in range(3):
            answer = await caller.post("/devices/bid-device/commands", json=run_body({"tool_name": "noop"}))
            assert answer.status_code == 200
            ids.add(answer.headers["X-Tether-Batch"])
    assert len(ids) == 3 and all(len(i) == 32 and int(i, 16) for i in ids)
    serving.cancel()
    await device.close()


# -- role and identity spoofing ---------------------------------------------------------------------

async def test_a_device_cannot_claim_another_devices_name_or_a_role(target):
    real = await registered(fake(target, "sp-real"))
    impostor = fake(target, "sp-impostor")
    answer = await impostor.register(claim="sp-real")
    assert answer.type is ServerMessageType.REGISTER_REFUSED
    assert "belongs to device 'sp-impostor'" in answer.error and "'sp-real'" in answer.error
    assert (await impostor.close_code())[0] == CLOSE_WRONG_DEVICE
    # a registration that claims a role or scopes is not a registration
    role = FakeDevice(target.aip, token(target, "device", "sp-role"), name="sp-role")
    await role.connect()
    await role.send(json.dumps({"type": "register", "protocol_version": "1.0", "payload": {
        "name": "sp-role", "instance_id": uuid.uuid4().hex, "role": "api", "scopes": ["admin"]}}))
    answer = await role.recv()
    assert answer.type is ServerMessageType.REGISTER_REFUSED and "role" in answer.error
    assert (await role.close_code())[0] == CLOSE_BAD_REGISTRATION
    # a second process with the real device's token, while it is live: refused, the first keeps its place
    twin = FakeDevice(target.aip, real.token, name="sp-real")
    answer = await twin.register()
    assert answer.type is ServerMessageType.REGISTER_REFUSED and "already connected" in answer.error
    assert (await twin.close_code())[0] == CLOSE_DUPLICATE
    # server-to-device frame types sent by a device are bad frames: an ERROR reply, the link lives on
    for kind in ("command", "register_ack", "cancel"):
        await real.send(json.dumps({"type": kind, "protocol_version": "1.0", "response_id": "r" * 32,
                                    "actions": [{"tool_name": "shell.run"}]}))
        error = await real.expect(ServerMessageType.ERROR)
        assert error.payload == {"reason": "invalid"} and error.error
    serving = real.serve_forever()
    async with api(target, token(target, "api", "sp-caller", ("execute",))) as caller:
        answer = await caller.post("/devices/sp-real/commands", json=run_body({"tool_name": "noop", "call_id": "c1"}))
    assert answer.status_code == 200 and answer.json()["results"][0]["status"] == "success"
    assert [r["status"] for r in audit(target, "sp-real") if r["call_id"] == "c1"] == ["success"]
    assert target.http.get("/api/v1/devices/sp-impostor", headers=target.auth).status_code == 404  # never registered
    serving.cancel()
    await real.close()


async def test_an_api_token_cannot_be_a_device_and_a_device_token_cannot_use_the_api(target):
    admin_like = token(target, "api", "sp-api", ("read", "execute", "admin"))
    with pytest.raises(InvalidStatus) as refused:
        await FakeDevice(target.aip, admin_like, name="sp-api").connect()
    assert refused.value.response.status_code == 401
    assert "an API token cannot register a device" in error_of(refused.value.response.body)
    device = await registered(fake(target, "sp-dev"))
    secret = device.token
    assert secret is not None
    async with api(target, secret) as http:
        for method, path, body in [
            ("GET", "/devices", None), ("GET", "/devices/sp-dev", None), ("GET", "/devices/sp-dev/tools", None),
            ("POST", "/devices/sp-dev/commands", run_body({"tool_name": "noop", "call_id": "by-device-token"})),
            ("POST", "/commands", run_body({"tool_name": "noop"})), ("GET", "/audit", None),
            ("GET", "/tokens", None), ("POST", "/tokens", {"kind": "api", "name": "sp-escalated", "scopes": ["admin"]}),
            ("DELETE", "/batches/" + "0" * 32, None), ("GET", "/tasks", None),
        ]:
            answer = await http.request(method, path, json=body)
            assert answer.status_code == 403, (method, path, answer.text)
            assert "a device token cannot use the API" in error_of(answer.content), (method, path)
    assert not [r for r in audit(target, "sp-dev") if r["call_id"] == "by-device-token"]  # never reached it
    assert "sp-escalated" not in json.dumps(target.http.get("/api/v1/tokens", headers=target.auth).json())
    assert wait_log(target, '"POST /api/v1/devices/sp-dev/commands HTTP/1.1" 403')
    await device.close()


# -- session reuse and stale replay -----------------------------------------------------------------

async def test_replayed_results_and_registrations_change_nothing(target):
    device = await registered(fake(target, "rp-device"))
    register_frame = ClientMessage(type=ClientMessageType.REGISTER, payload={
        "name": "rp-device", "instance_id": device.instance_id, "profile": {}})
    async with api(target, token(target, "api", "rp-caller", ("execute",))) as caller:
        first = asyncio.create_task(caller.post("/devices/rp-device/commands", json=run_body(
            {"tool_name": "get_balance", "call_id": "job-1"})))
        old = await device.expect(ServerMessageType.COMMAND)
        old_results = [Result(status=ResultStatus.SUCCESS, result={"balance": 100}, call_id="job-1")]
        await device.results(old.response_id, old_results)
        assert (await first).json()["results"][0]["result"] == {"balance": 100}
        # the same call_id again, in a new batch: the old batch's frame replayed does not answer it
        second = asyncio.create_task(caller.post("/devices/rp-device/commands", json=run_body(
            {"tool_name": "get_balance", "call_id": "job-1"})))
        new = await device.expect(ServerMessageType.COMMAND)
        assert new.response_id != old.response_id
        await device.results(old.response_id, old_results)
        await device.sync()
        assert not second.done()
        await device.results(new.response_id, [Result(status=ResultStatus.SUCCESS, result={"balance": 7},
                                                      call_id="job-1")])
        assert (await second).json()["results"][0]["result"] == {"balance": 7}
        # and replaying the finished batch's frame once more, then the registration on the live link
        await device.results(new.response_id, old_results)
        await device.send(register_frame)
        error = await device.expect(ServerMessageType.ERROR)
        assert "already registered as rp-device" in error.error and error.payload == {"reason": "unexpected"}
    # both are told of in the log once their lookups answered (off the event loop with PostgreSQL)
    late = "late results from device rp-device for finished batch"
    wait_for(lambda: len(log_lines(target, late)) >= 2, "two late-result log lines", procs=(target.proc.popen,))
    assert len(log_lines(target, late)) == 2
    rows = [r for r in audit(target, "rp-device") if r["call_id"] == "job-1"]
    assert sorted(r["response_id"] for r in rows) == sorted([old.response_id, new.response_id])
    assert all(r["status"] == "success" for r in rows)
    # the old registration replayed on a new connection after the token is revoked: refused at the handshake
    revoked = target.http.delete("/api/v1/tokens/rp-device", headers=target.auth)
    assert revoked.status_code == 200, revoked.text
    assert await device.close_code() == (4401, "unauthorized: token revoked")
    replay = FakeDevice(target.aip, device.token, name="rp-device", instance_id=device.instance_id)
    with pytest.raises(InvalidStatus) as refused:
        await replay.register()
    assert refused.value.response.status_code == 401
    assert "unknown or revoked device token" in error_of(refused.value.response.body)


# -- cross-device reads -----------------------------------------------------------------------------

async def test_a_device_cannot_read_or_touch_another_devices_batches_or_record(target):
    victim, snoop = fake(target, "cx-victim"), fake(target, "cx-snoop")
    await registered(victim)
    await registered(snoop)
    async with api(target, snoop.token or "") as as_device:
        for path in ("/devices/cx-victim", "/devices/cx-victim/tools", "/audit?device=cx-victim"):
            answer = await as_device.get(path)
            assert answer.status_code == 403 and "device token" in error_of(answer.content), path
    # its own DEVICE_INFO cannot describe another device
    await snoop.send(ClientMessage(type=ClientMessageType.DEVICE_INFO, payload={"tags": ["snooped"],
                                                                                "name": "cx-victim"}))
    await snoop.sync()
    victim_view = target.http.get("/api/v1/devices/cx-victim", headers=target.auth).json()
    assert victim_view["tags"] == [] and "snooped" in target.http.get(
        "/api/v1/devices/cx-snoop", headers=target.auth).json()["tags"]
    # the victim's streamed batch: the snoop's events and error for it go nowhere
    caller = api(target, token(target, "api", "cx-caller", ("execute",)))
    async with caller, caller.stream("POST", "/devices/cx-victim/commands", headers={"Accept": "text/event-stream"},
                                     json=run_body({"tool_name": "tail_log", "call_id": "t-1"})) as stream:
        rid = stream.headers["X-Tether-Batch"]
        command = await victim.expect(ServerMessageType.COMMAND)
        assert command.response_id == rid
        event = {"kind": "output", "response_id": rid, "call_id": "t-1", "data": {"data": "snoop's line"}}
        await snoop.send(ClientMessage(type=ClientMessageType.EVENT, payload=event))
        await snoop.send(ClientMessage(type=ClientMessageType.ERROR, prev_response_id=rid, error="fail it"))
        await snoop.sync()
        await victim.send(ClientMessage(type=ClientMessageType.EVENT, payload={
            **event, "data": {"data": "victim's line"}}))
        await victim.results(rid, [Result(status=ResultStatus.SUCCESS, result={"lines": 1}, call_id="t-1")])
        body = (await stream.aread()).decode()
    assert "victim's line" in body and "snoop's line" not in body and "fail it" not in body
    assert '"status": "success"' in body or '"status":"success"' in body
    assert wait_log(target, "device cx-snoop reported an error for batch", rid)
    [row] = [r for r in audit(target, "cx-victim") if r["call_id"] == "t-1"]
    assert row["status"] == "success" and row["error"] is None
    for device in (victim, snoop):
        await device.close()


# -- result squatting -------------------------------------------------------------------------------

async def test_results_sent_before_their_batch_exists_are_not_kept(target):
    squatter, victim = fake(target, "sq-squatter"), fake(target, "sq-victim")
    await registered(squatter)
    await registered(victim)
    guesses = ["0" * 32, "f" * 32, *(uuid.uuid4().hex for _ in range(50))]
    for guess in guesses:
        for call_id in ("nightly-1", "nightly-2"):
            await squatter.results(guess, [Result(status=ResultStatus.SUCCESS, result={"said": "squatted"},
                                                  call_id=call_id)])
    await squatter.sync()
    async with api(target, token(target, "api", "sq-caller", ("execute",))) as caller:
        # another device's batch, with the call_id the squatter guessed
        answering = victim.serve_forever(lambda c: Result(status=ResultStatus.SUCCESS, result={"said": "real"},
                                                          call_id=c.call_id))
        answer = await caller.post("/devices/sq-victim/commands", json=run_body(
            {"tool_name": "report", "call_id": "nightly-1"}))
        answering.cancel()
        assert answer.json()["results"][0]["result"] == {"said": "real"}
        # and its own later batch: it is answered by what the squatter says after receiving it, not before
        mine = asyncio.create_task(caller.post("/devices/sq-squatter/commands", json=run_body(
            {"tool_name": "report", "call_id": "nightly-2"})))
        command = await squatter.expect(ServerMessageType.COMMAND)
        assert command.response_id not in guesses
        await squatter.sync()
        assert not mine.done()
        await squatter.results(command.response_id, [Result(status=ResultStatus.FAILURE, error="ran, failed",
                                                             call_id="nightly-2")])
        assert (await mine).json()["results"][0]["error"] == "ran, failed"
    assert len(wait_log(target, "refused results from device sq-squatter", "no such batch was sent to it")) \
        >= len(guesses) * 2
    assert [r["status"] for r in audit(target, "sq-victim") if r["call_id"] == "nightly-1"] == ["success"]
    assert [r["status"] for r in audit(target, "sq-squatter") if r["call_id"] == "nightly-2"] == ["failure"]
    for device in (squatter, victim):
        await device.close()


# -- device-info disclosure -------------------------------------------------------------------------

async def test_what_a_read_token_and_a_device_token_can_learn(target):
    device = fake(target, "dx-device")
    device.profile = device.profile.model_validate({"os": {"platform": "linux"}, "tags": ["lab"]})
    ack = await device.register()
    assert ack.type is ServerMessageType.REGISTER_ACK
    # what a device learns: its own name and the timers, nothing about any other device
    assert set(ack.payload) == {"device", "heartbeat_interval", "heartbeat_timeout", "grace_period",
                                "max_frame_bytes", "resumed"} and ack.payload["device"] == "dx-device"
    reader = token(target, "api", "dx-reader", ("read",))
    hashes = [hashlib.sha256(s.encode()).hexdigest() for s in SECRETS]
    async with api(target, reader) as http:
        seen = []
        for path in ("/devices", "/devices/dx-device"):
            answer = await http.get(path)
            seen.append(answer.text)
        assert json.loads(seen[1])["profile"]["tags"] == ["lab"]  # read may see profiles: that is its scope
        for path, method in (("/tokens", "GET"), ("/audit", "GET"), ("/batches/" + "0" * 32, "DELETE")):
            answer = await http.request(method, path)
            assert answer.status_code == 403 and "lacks the" in error_of(answer.content), path
            seen.append(answer.text)
        answer = await http.post("/devices/dx-device/commands", json=run_body({"tool_name": "noop"}))
        assert answer.status_code == 403 and "lacks the 'execute' scope" in error_of(answer.content)
    anonymous = target.http.get("/api/v1/health")
    seen += [anonymous.text, target.http.get("/api/v1/tokens", headers=target.auth).text]
    for wrong in ("tapi_" + "x" * 40, SECRETS[-1] + "x"):
        answer = target.http.get("/api/v1/devices", headers={"Authorization": f"Bearer {wrong}"})
        assert answer.status_code == 401 and wrong not in answer.text
        seen.append(answer.text)
    text = "\n".join(seen)
    assert "dx-device" not in anonymous.text
    for secret in [*SECRETS, target.api_token, target.device_token]:
        assert secret not in text
    for digest in hashes:
        assert digest not in text
    assert device.instance_id not in text  # it would let a token thief take over the live link ("resumed")
    for secret in [*SECRETS, target.api_token, target.device_token]:
        assert secret not in target.log()
    await device.close()


# -- name traversal ---------------------------------------------------------------------------------

BAD_NAMES = ["../evil", "..", ".", "a/b", "a\\b", "a\x00b", "a\nb", "a\x1b[2Kb", "x" * 200, "", " lead"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_token_name_that_could_traverse_or_forge_is_refused(target, name):
    answer = target.http.post("/api/v1/tokens", headers=target.auth, json={"kind": "device", "name": name})
    assert answer.status_code == 422 and "name" in error_of(answer.content)
    assert not any(t["name"] == name for t in target.http.get("/api/v1/tokens", headers=target.auth).json())


@pytest.mark.parametrize("path", ["/api/v1/devices/..%2F..%2Fetc%2Fpasswd", "/api/v1/devices/%2e%2e",
                                  "/api/v1/devices/a%00b", "/api/v1/devices/a%0Ab/tools",
                                  "/api/v1/devices/" + "x" * 4000, "/api/v1/devices/..%2Falpha/commands"])
def test_a_device_name_in_a_path_finds_nothing(target, path):
    method = "POST" if path.endswith("/commands") else "GET"
    answer = target.http.request(method, path, headers=target.auth, json=run_body({"tool_name": "noop"}))
    assert answer.status_code == 404, answer.text
    error = error_of(answer.content)  # the router's (a decoded '/' matches no route) or the route's own
    assert error == "Not Found" or error.startswith("no device named"), error


async def test_tool_session_and_computer_names_that_traverse_are_refused_and_audited(target, tmp_path):
    async with real_device(target, "nt-device", tmp_path) as root, \
            api(target, token(target, "api", "nt-caller", ("execute",))) as caller:
        target_file = {"file_path": str(root / "made.txt"), "content": "x"}
        outcomes: dict[str, tuple[int, str]] = {}
        for label, body in [
            *((f"tool {name!r}", run_body({"tool_name": name, "call_id": f"tool-{i}"}))
              for i, name in enumerate(["../../bin/sh", "files/../shell.run", "write_file\x00", "\nwrite_file",
                                        "w" * 10_000])),
            *((f"session {session!r}", run_body({"tool_name": "write_file", "parameters": target_file,
                                                 "call_id": f"session-{i}"}, session_id=session))
              for i, session in enumerate(["../../../escape", "..", "a/b", "a\x00b", "a\nb", "s" * 129])),
            ("agent_name '../x'", run_body({"tool_name": "write_file", "parameters": target_file,
                                            "call_id": "agent_name-1"}, agent_name="../x")),
        ]:
            answer = await caller.post("/devices/nt-device/commands", json=body)
            if answer.status_code == 200:
                [result] = answer.json()["results"]
                assert result["status"] == "failure" and result["error"], (label, result)
                outcomes[body["commands"][0]["call_id"]] = (200, result["error"])
            else:
                assert answer.status_code in (403, 422), (label, answer.text)
                outcomes[body["commands"][0]["call_id"]] = (answer.status_code, error_of(answer.content))
        # process_name and root_name are labels (they key a computer in memory; an unknown root is the
        # default one), never paths: the command runs as itself
        label = await caller.post("/devices/nt-device/commands", json=run_body(
            {"tool_name": "write_file", "parameters": {"file_path": str(root / "label.txt"), "content": "x"},
             "call_id": "label-1"}, process_name="../../x\x00", root_name="../../y\n"))
        assert label.status_code == 200 and label.json()["results"][0]["status"] == "success", label.text
    assert not (root / "made.txt").exists(), "a command with a traversing name ran"
    assert [p.name for p in tmp_path.rglob("*.txt")] == ["label.txt"]
    assert not list(tmp_path.rglob("escape")), "a session name made a directory outside the journal"
    rows = {r["call_id"]: r for r in audit(target, "nt-device")}
    for call_id, (status, error) in outcomes.items():
        if status == 422:  # refused while parsing the request: no command was made of it
            continue
        assert call_id in rows, f"no audit row for {call_id} ({status}: {error})"
        # PostgreSQL's text holds no NUL: the store writes U+FFFD in its place (tether.server.store.engine)
        stored = error.replace("\x00", "\ufffd") if dbkit.backend() == "postgres" else error
        assert rows[call_id]["status"] == "failure" and rows[call_id]["error"] == stored, rows[call_id]
    assert all(error.startswith("unknown tool")
               for call_id, (_, error) in outcomes.items() if call_id.startswith("tool"))
    assert all("invalid session id" in error or "at most 128" in error
               for call_id, (_, error) in outcomes.items() if call_id.startswith("session"))
    assert outcomes["agent_name-1"][1].startswith("unknown agent '../x'")
    assert "\x00" not in target.log() and "\x1b" not in target.log()

