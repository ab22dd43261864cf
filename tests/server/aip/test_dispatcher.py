"""`WebSocketCommandDispatcher` through a real server: results, forgeries, timeouts, reconnection, audit.

The scripted device (aip_testkit) answers exactly as each test says, so every rule about which
results count is checked from the outside, over a real socket.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.kits.aip import WAIT, FakeDevice, ServerFactory, logged, ok
from tether.protocol.messages import ClientMessage, ClientMessageType, Event, ServerMessageType, TaskStatus
from tether.protocol.models import Command, Result, ResultStatus


@pytest.fixture
async def servers(tmp_path):
    factory = ServerFactory(tmp_path)
    yield factory
    await factory.stop_all()


def commands(*names: str) -> list[Command]:
    return [Command(tool_name=name, parameters={"n": i}) for i, name in enumerate(names)]


async def test_round_trip_matches_results_by_call_id_in_command_order(servers):
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    batch = commands("a", "b", "c")
    run = asyncio.create_task(srv.hub.dispatcher("laptop", session_id="s1", agent_name="planner")
                              .execute_commands(batch, timeout=WAIT, early_exit=False))
    sent = await dev.expect(ServerMessageType.COMMAND)
    assert [c.call_id for c in sent.actions] == [c.call_id for c in batch]
    assert (sent.session_id, sent.agent_name, sent.timeout, sent.early_exit) == ("s1", "planner", WAIT, False)
    await dev.results(sent.response_id, [ok(c) for c in reversed(sent.actions)])
    results = await run
    assert [r.call_id for r in results] == [c.call_id for c in batch]
    assert [r.result["tool"] for r in results] == ["a", "b", "c"]


async def test_partial_frames_events_and_load(servers):
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    events: list[Event] = []
    batch = commands("a", "b", "c")
    run = asyncio.create_task(srv.hub.dispatcher("laptop", on_event=events.append).execute_commands(batch, WAIT))
    sent = await dev.expect(ServerMessageType.COMMAND)
    record = srv.hub.registry.get("laptop")
    assert (record.status, record.load) == ("busy", 1)
    first, second, third = sent.actions
    await dev.results(sent.response_id, [ok(first)], status=TaskStatus.CONTINUE)
    await dev.send(ClientMessage(type=ClientMessageType.EVENT, payload=Event(
        kind="output", response_id=sent.response_id, call_id=second.call_id, data={"stdout": "hi\n"}).model_dump()))
    await dev.results(sent.response_id, [ok(second)], status=TaskStatus.CONTINUE)
    await dev.sync()
    assert not run.done()
    assert [(e.kind, e.data) for e in events] == [("output", {"stdout": "hi\n"})]
    await dev.results(sent.response_id, [ok(third)], status=TaskStatus.CONTINUE)  # all in: done without COMPLETED
    assert [r.status for r in await run] == [ResultStatus.SUCCESS] * 3
    assert (record.status, record.load) == ("online", 0)


async def test_completed_without_every_result_fails_only_the_missing_ones(servers):
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands(commands("a", "b"), WAIT))
    sent = await dev.expect(ServerMessageType.COMMAND)
    await dev.results(sent.response_id, [ok(sent.actions[0])])
    first, second = await run
    assert first.ok and second.status is ResultStatus.FAILURE and "without a result" in second.error


async def test_a_result_forged_by_another_device_is_refused(servers, caplog):
    srv = await servers.start()
    laptop, box = srv.device("laptop"), srv.device("box")
    await laptop.register()
    await box.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands(commands("a"), WAIT))
    sent = await laptop.expect(ServerMessageType.COMMAND)
    forged = Result(status=ResultStatus.SUCCESS, result="forged", call_id=sent.actions[0].call_id)
    with caplog.at_level(logging.WARNING, logger="tether.server.hub"):
        await box.results(sent.response_id, [forged])
        await box.sync()
        await logged(caplog, "refused results from device box")
    assert not run.done()
    await laptop.results(sent.response_id, [ok(sent.actions[0])])
    [result] = await run
    assert result.result == {"tool": "a", "args": {"n": 0}}


async def test_results_for_call_ids_not_outstanding_are_ignored(servers, caplog):
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands(commands("a", "b"), WAIT))
    sent = await dev.expect(ServerMessageType.COMMAND)
    a, b = sent.actions
    stranger = Result(status=ResultStatus.SUCCESS, call_id="not-in-this-batch")
    with caplog.at_level(logging.WARNING, logger="tether.server.hub"):
        await dev.results(sent.response_id, [ok(a), stranger], status=TaskStatus.CONTINUE)
        await dev.results(sent.response_id, [Result(status=ResultStatus.FAILURE, error="dup", call_id=a.call_id),
                                             ok(b)])
    results = await run
    assert [r.status for r in results] == [ResultStatus.SUCCESS, ResultStatus.SUCCESS]
    assert caplog.text.count("not outstanding") == 2


async def test_timeout_sends_cancel_says_outcome_pending_and_records_the_late_result(servers, caplog):
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands(commands("a", "b"), timeout=0.3))
    sent = await dev.expect(ServerMessageType.COMMAND)
    await dev.results(sent.response_id, [ok(sent.actions[0])], status=TaskStatus.CONTINUE)
    cancel = await dev.expect(ServerMessageType.CANCEL)
    assert cancel.response_id == sent.response_id
    first, second = await run
    assert first.ok and second.outcome_pending and "timed out after 0.3s" in second.error
    assert second.error.startswith("outcome pending:") and sent.response_id in second.error
    assert second.result["batch_id"] == sent.response_id and second.result["call_id"] == sent.actions[1].call_id
    rows = {r["call_id"]: r for r in srv.store.audit.batch(sent.response_id)}
    assert rows[sent.actions[1].call_id]["status"] == "pending"
    with caplog.at_level(logging.WARNING, logger="tether.server.hub"):
        await dev.results(sent.response_id, [ok(sent.actions[1])])
        await dev.sync()
        await logged(caplog, f"late results from device laptop for batch {sent.response_id} recorded")
    late = {r["call_id"]: r for r in srv.store.audit.batch(sent.response_id)}[sent.actions[1].call_id]
    assert late["status"] == "success" and late["error"].startswith("late:"), late
    assert srv.hub.registry.get("laptop").load == 0


async def test_offline_and_unknown_devices_fail_at_once(servers):
    srv = await servers.start(grace_period=0.0)
    dev = srv.device("laptop")
    await dev.register()
    await dev.close()
    assert await srv.hub.registry.wait_until(lambda: srv.hub.registry.get("laptop").status == "offline", WAIT)
    [offline] = await srv.hub.dispatcher("laptop").execute_commands(commands("a"), timeout=WAIT)
    assert offline.status is ResultStatus.FAILURE and "device laptop is offline" in offline.error
    [unknown] = await srv.hub.dispatcher("ghost").execute_commands(commands("a"), timeout=WAIT)
    assert "no device named ghost" in unknown.error


async def test_drop_mid_batch_and_reconnect_within_grace_delivers_exactly_once(servers, caplog):
    srv = await servers.start(grace_period=WAIT)
    token = srv.token("laptop")
    dev = FakeDevice(srv.url, token, name="laptop")
    await dev.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop", requested_by="tester").execute_commands(
        commands("a", "b"), timeout=WAIT * 2))
    sent = await dev.expect(ServerMessageType.COMMAND)
    dev.abort()  # the network fails; the device process lives on
    record = srv.hub.registry.get("laptop")
    assert await srv.hub.registry.wait_until(lambda: record.status == "offline", WAIT)
    queued = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands(commands("c"), timeout=WAIT * 2))
    again = FakeDevice(srv.url, token, name="laptop", instance_id=dev.instance_id)
    ack = await again.register()
    assert ack.payload["resumed"] is True
    # after the ack: the batch in flight is sent again (the device dedups by call_id, so a result
    # lost with the old link is recovered) and the one queued while the device was away goes out
    first = await again.expect(ServerMessageType.COMMAND)
    second = await again.expect(ServerMessageType.COMMAND)
    assert {first.response_id, second.response_id} >= {sent.response_id}
    queued_cmd = second if first.response_id == sent.response_id else first
    assert queued_cmd.actions[0].tool_name == "c"
    resent = first if queued_cmd is second else second
    assert [c.call_id for c in resent.actions] == [c.call_id for c in sent.actions]
    with caplog.at_level(logging.WARNING, logger="tether.server.hub"):
        for _ in range(2):  # the outbox delivers twice: only the first counts
            await again.results(sent.response_id, [ok(c) for c in sent.actions])
        await again.sync()
    results = await run
    assert [r.result["tool"] for r in results] == ["a", "b"]
    assert "late results" in caplog.text
    await again.results(queued_cmd.response_id, [ok(queued_cmd.actions[0])])
    assert (await queued)[0].ok
    rows = srv.store.audit.rows(device="laptop")
    assert sorted(r["tool_name"] for r in rows) == ["a", "b", "c"]


async def test_disconnect_past_grace_fails_the_batch(servers):
    srv = await servers.start(grace_period=0.2)
    dev = srv.device("laptop")
    await dev.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands(commands("a", "b"), timeout=WAIT))
    sent = await dev.expect(ServerMessageType.COMMAND)
    await dev.results(sent.response_id, [ok(sent.actions[0])], status=TaskStatus.CONTINUE)
    await dev.sync()
    await dev.close()
    first, second = await asyncio.wait_for(run, WAIT)
    assert first.ok
    # it may still be running (the device is away, not known to have stopped): pending, not a failure
    assert second.outcome_pending and "did not come back within the 0.2s grace period" in second.error


async def test_a_restarted_device_fails_its_in_flight_batch_at_once(servers):
    srv = await servers.start(grace_period=WAIT)
    token = srv.token("laptop")
    dev = FakeDevice(srv.url, token, name="laptop")
    await dev.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands(commands("a"), timeout=WAIT * 2))
    await dev.expect(ServerMessageType.COMMAND)
    srv.hub._conns["laptop"].last_seen -= 1000  # the old connection is stale, not yet noticed
    fresh = FakeDevice(srv.url, token, name="laptop")  # a new process: a new instance_id
    ack = await fresh.register()
    assert ack.type is ServerMessageType.REGISTER_ACK and ack.payload["resumed"] is False
    [result] = await asyncio.wait_for(run, WAIT)
    assert "device laptop restarted; outcome unknown" in result.error
    assert (await dev.close_code())[0] == 4000


async def test_cancel_reaches_the_device_and_the_caller_gets_failures(servers):
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    dispatcher = srv.hub.dispatcher("laptop")
    run = asyncio.create_task(dispatcher.execute_commands(commands("a"), timeout=WAIT))
    sent = await dev.expect(ServerMessageType.COMMAND)
    await dispatcher.cancel()
    assert (await dev.expect(ServerMessageType.CANCEL)).response_id == sent.response_id
    [result] = await run
    assert result.status is ResultStatus.FAILURE and "cancelled" in result.error
    caller = asyncio.create_task(dispatcher.execute_commands(commands("b"), timeout=WAIT))
    second = await dev.expect(ServerMessageType.COMMAND)
    caller.cancel()  # the caller itself goes away
    assert (await dev.expect(ServerMessageType.CANCEL)).response_id == second.response_id
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert not await srv.hub.cancel(second.response_id)


async def test_an_error_on_the_device_fails_the_unfinished_commands(servers):
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands(commands("a", "b"), WAIT))
    sent = await dev.expect(ServerMessageType.COMMAND)
    await dev.results(sent.response_id, [ok(sent.actions[0])], status=TaskStatus.CONTINUE)
    await dev.send(ClientMessage(type=ClientMessageType.ERROR, prev_response_id=sent.response_id,
                                 error="router crashed"))
    first, second = await run
    assert first.ok and "device laptop reported: router crashed" in second.error


async def test_two_devices_in_parallel_each_caller_gets_its_own_results(servers):
    srv = await servers.start()
    devices = {name: srv.device(name) for name in ("laptop", "box")}
    serving = []
    for name, dev in devices.items():
        await dev.register()
        serving.append(dev.serve_forever(lambda c, name=name: Result(status=ResultStatus.SUCCESS, result=name,
                                                                     call_id=c.call_id)))
    runs = {name: [srv.hub.dispatcher(name).execute_commands(commands("x", "y"), WAIT) for _ in range(5)]
            for name in devices}
    for name, coros in runs.items():
        for results in await asyncio.gather(*coros):
            assert [r.result for r in results] == [name, name]
    for task in serving:
        task.cancel()


async def test_every_result_is_audited_with_who_asked(servers):
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop", requested_by="api:ops").execute_commands(
        [Command(tool_name="shell.run", parameters={"argv": ["ls"]}), Command(tool_name="files.read")], WAIT))
    sent = await dev.expect(ServerMessageType.COMMAND)
    await dev.results(sent.response_id, [ok(sent.actions[0]),
                                         Result.failure("no such file", call_id=sent.actions[1].call_id)])
    await run
    rows = srv.store.audit.rows(device="laptop")
    assert [(r["tool_name"], r["status"], r["requested_by"], r["response_id"]) for r in reversed(rows)] == [
        ("shell.run", "success", "api:ops", sent.response_id), ("files.read", "failure", "api:ops", sent.response_id)]
    assert '"argv": ["ls"]' in rows[1]["arguments"] and rows[0]["error"] == "no such file"


async def test_duplicate_call_ids_are_refused_before_sending(servers):
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    twins = [Command(tool_name="a", call_id="same"), Command(tool_name="b", call_id="same")]
    results = await srv.hub.dispatcher("laptop").execute_commands(twins, WAIT)
    assert all("more than once" in r.error for r in results) and [r.call_id for r in results] == ["same", "same"]
    assert await srv.hub.dispatcher("laptop").execute_commands([], WAIT) == []


async def test_shutdown_fails_pending_batches(servers):
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands(commands("a"), WAIT))
    await dev.expect(ServerMessageType.COMMAND)
    await srv.hub.aclose()
    [result] = await run
    assert "shutting down" in result.error
    assert (await dev.close_code())[0] == 1001
