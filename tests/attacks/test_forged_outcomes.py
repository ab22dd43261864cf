"""Attacks on late outcomes (issue 28, docs/outcomes.md): the server now records a result that comes
after its caller stopped waiting, so a device that is not the batch's tries to write its outcome — a
forged success for another device's pending command, a result for a batch nobody sent, a second,
different result after the real one — and an API token tries to read another token's batch record.
Real server hub over real sockets (tests/kits/aip.py), the audit read back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from tests.kits.aip import WAIT, FakeDevice, ServerFactory, logged, ok
from tether.protocol.messages import ServerMessageType
from tether.protocol.models import Command, Result, ResultStatus


@pytest.fixture
async def servers(tmp_path):
    factory = ServerFactory(tmp_path)
    yield factory
    await factory.stop_all()


async def _pending_batch(srv, victim: FakeDevice) -> tuple[str, Command]:
    """A batch on `victim` whose caller timed out: its row is `pending`."""
    run = asyncio.create_task(srv.hub.dispatcher("victim").execute_commands(
        [Command(tool_name="work", parameters={})], timeout=0.3))
    sent = await victim.expect(ServerMessageType.COMMAND)
    await victim.expect(ServerMessageType.CANCEL)
    [result] = await asyncio.wait_for(run, WAIT)
    assert result.outcome_pending, result
    [row] = srv.store.audit.batch(sent.response_id)
    assert row["status"] == "pending", row
    return sent.response_id, sent.actions[0]


async def test_another_device_cannot_settle_a_pending_outcome(servers) -> None:
    srv = await servers.start()
    victim = FakeDevice(srv.url, srv.token("victim"), name="victim")
    attacker = FakeDevice(srv.url, srv.token("attacker"), name="attacker")
    await victim.register()
    await attacker.register()
    response_id, command = await _pending_batch(srv, victim)
    # the attacker knows the ids (say, from a leaked log) and forges the outcome it would like recorded
    await attacker.results(response_id, [Result(status=ResultStatus.SUCCESS, result={"forged": True},
                                                call_id=command.call_id)])
    await attacker.sync()
    [row] = srv.store.audit.batch(response_id)
    assert row["status"] == "pending" and row["device"] == "victim", row  # untouched
    # the real device's answer settles it, once; a second, different answer changes nothing
    await victim.results(response_id, [ok(command)])
    await victim.sync()
    await victim.results(response_id, [Result(status=ResultStatus.FAILURE, error="second", call_id=command.call_id)])
    await victim.sync()
    [row] = srv.store.audit.batch(response_id)
    assert row["status"] == "success" and row["error"].startswith("late:"), row


async def test_a_result_for_a_batch_never_sent_writes_nothing(servers) -> None:
    srv = await servers.start()
    attacker = FakeDevice(srv.url, srv.token("attacker"), name="attacker")
    await attacker.register()
    await attacker.results("f" * 32, [Result(status=ResultStatus.SUCCESS, call_id="invented")])
    await attacker.sync()
    assert srv.store.audit.batch("f" * 32) == []
    assert srv.store.audit.rows(device="attacker") == []


async def test_a_flood_of_results_for_nothing_stops_being_looked_up(servers, caplog) -> None:
    """Each late result is looked up in the audit (a write transaction): a device sending results for
    batches that have no open outcome is no longer looked up after _LATE_MISSES of them in a row."""
    from tether.server.aip.batches import ledger as batches

    srv = await servers.start()
    attacker = FakeDevice(srv.url, srv.token("attacker"), name="attacker")
    await attacker.register()
    looked: list[str] = []
    real = srv.hub._batches.on_late

    def counting(device: str, rid: str, results: list[Result], then: Callable[[int], None]) -> object:
        looked.append(rid)
        return real(device, rid, results, then)

    srv.hub._batches.on_late = counting
    with caplog.at_level(logging.WARNING, logger="tether.server.hub"):
        for i in range(batches._LATE_MISSES + 50):
            await attacker.results(f"{i:032x}", [Result(status=ResultStatus.SUCCESS, call_id="x")])
        await attacker.sync()
        # the lookups answer off the event loop with PostgreSQL: the last miss is told of once they all have
        await logged(caplog, "no longer looked up", timeout=60)
    assert len(looked) == batches._LATE_MISSES, len(looked)
