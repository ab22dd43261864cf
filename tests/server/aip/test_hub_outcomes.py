"""`DeviceHub.query_outcomes` over a real socket (issue 28, item 2): the server asks a device what became of
earlier calls; an offline device, a device that never answers (one that predates OUTCOME_QUERY) and an
answer that leaves a call out all read as `unknown`, within the timeout given; never an exception."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.kits.aip import ServerFactory
from tether.protocol.messages import CallOutcome, CallRef, ClientMessage, ClientMessageType, ServerMessageType
from tether.protocol.models import Result, ResultStatus


@pytest.fixture
async def servers(tmp_path):
    factory = ServerFactory(tmp_path)
    yield factory
    await factory.stop_all()


async def test_an_offline_or_unknown_device_is_unknown_at_once(servers) -> None:
    srv = await servers.start()
    [outcome] = (await srv.hub.query_outcomes("nobody", [CallRef(call_id="c1")], 5.0)).values()
    assert outcome.state == "unknown" and "no device named nobody" in (outcome.note or "")


async def test_a_device_that_never_answers_is_unknown_after_the_timeout(servers) -> None:
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    started = time.monotonic()
    asking = asyncio.create_task(srv.hub.query_outcomes("laptop", [CallRef(call_id="c1", response_id="r1")], 0.5))
    query = await dev.expect(ServerMessageType.OUTCOME_QUERY)  # an old device: it reads it and says nothing
    assert (query.payload or {})["calls"] == [{"call_id": "c1", "response_id": "r1"}] and not query.actions
    outcome = (await asyncio.wait_for(asking, 5))["c1"]
    assert outcome.state == "unknown" and "did not answer" in (outcome.note or "")
    assert time.monotonic() - started < 3


async def test_the_devices_report_is_the_answer_and_the_audit_names_the_batch(servers) -> None:
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    srv.store.audit.record("task:x", "laptop", "c1", "shell.run", {}, "sent", None, response_id="r-audited")
    asking = asyncio.create_task(srv.hub.query_outcomes("laptop", [CallRef(call_id="c1"), CallRef(call_id="c2")],
                                                        5.0))
    query = await dev.expect(ServerMessageType.OUTCOME_QUERY)
    assert (query.payload or {})["calls"] == [{"call_id": "c1", "response_id": "r-audited"}, {"call_id": "c2"}]
    done = Result(status=ResultStatus.SUCCESS, result={"stdout": "ok\n"}, call_id="c1")
    await dev.send(ClientMessage(type=ClientMessageType.OUTCOME_REPORT, prev_response_id=query.response_id,
                                 payload={"outcomes": [CallOutcome(call_id="c1", state="finished",
                                                                   response_id="r-audited", result=done
                                                                   ).model_dump(mode="json")]}))
    outcomes = await asyncio.wait_for(asking, 5)
    assert outcomes["c1"].state == "finished" and outcomes["c1"].result == done
    assert outcomes["c2"].state == "unknown" and "did not report" in (outcomes["c2"].note or "")
