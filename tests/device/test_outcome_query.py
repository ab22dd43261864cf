"""A device answers the server's OUTCOME_QUERY from its record of finished calls and its batches in hand,
and never runs anything for it (issue 28, item 2). A real device and real processes against the scripted
AIP server of test_connection; the command appends to a file, so its runs are counted."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.device.test_connection import WAITER, ScriptedServer, command, connected, results_of, run
from tether.device.local import LocalDevice, build_device
from tether.protocol.messages import CallOutcome, CallRef, ClientMessageType, ServerMessage, ServerMessageType
from tether.protocol.models import Command
from tether.tools.policy.model import default_policy


@pytest.fixture
def local(tmp_path: Path) -> LocalDevice:
    roots = [str(tmp_path)]
    policy = default_policy().model_copy(update={"read_roots": roots, "write_roots": roots})
    return build_device(policy=policy, state_dir=tmp_path / "state", sandbox=False)


@pytest.fixture
def counted(tmp_path: Path) -> Command:
    (tmp_path / "waiter.py").write_text(WAITER)  # waits for `go`, then appends "x" to `runs`
    return run(tmp_path, "python3", str(tmp_path / "waiter.py"), str(tmp_path), call_id="step-1")


async def ask(server: ScriptedServer, *calls: CallRef) -> dict[str, CallOutcome]:
    query = ServerMessage(type=ServerMessageType.OUTCOME_QUERY,
                          payload={"calls": [c.model_dump(exclude_none=True) for c in calls]})
    await server.send(query)
    while True:
        answer = await server.next(ClientMessageType.OUTCOME_REPORT)
        if answer.prev_response_id == query.response_id:
            outcomes = [CallOutcome.model_validate(o) for o in (answer.payload or {})["outcomes"]]
            assert [o.call_id for o in outcomes] == [c.call_id for c in calls]  # one per call, in order
            return {o.call_id: o for o in outcomes}


async def test_the_device_reports_running_then_finished_and_runs_nothing_for_it(
        tmp_path: Path, local: LocalDevice, counted: Command) -> None:
    async with ScriptedServer() as server, connected(server, local) as conn:
        batch = command(counted)
        await server.send(batch)
        await server.output("started")
        mine = CallRef(call_id="step-1", response_id=batch.response_id)
        running = await ask(server, mine, CallRef(call_id="step-1"), CallRef(call_id="never-sent"))
        assert running["step-1"].state == "running" and running["step-1"].response_id == batch.response_id
        assert running["never-sent"].state == "unknown" and running["never-sent"].note
        (tmp_path / "go").touch()
        [result] = results_of(await server.results(batch.response_id))
        for _ in range(3):  # asked again and again: answered from the record each time
            finished = (await ask(server, mine))["step-1"]
            assert finished.state == "finished" and finished.result == result and result.ok
        by_label = (await ask(server, CallRef(call_id="step-1")))["step-1"]  # the call_id alone names one call
        assert by_label.state == "finished" and by_label.response_id == batch.response_id
        other = (await ask(server, CallRef(call_id="step-1", response_id="another-batch")))["step-1"]
        assert other.state == "unknown"  # the same label in a batch this device never had
    assert (tmp_path / "runs").read_text() == "x" and conn.batches.executed == 1


async def test_a_call_id_several_batches_carried_is_unknown_without_its_batch(tmp_path: Path,
                                                                             local: LocalDevice) -> None:
    async with ScriptedServer() as server, connected(server, local) as conn:
        (tmp_path / "count.py").write_text("import sys\nopen(sys.argv[1], 'a').write('x\\n')\n")
        batches = [command(run(tmp_path, "python3", str(tmp_path / "count.py"), str(tmp_path / "count"),
                               call_id="nightly")) for _ in range(2)]
        for batch in batches:
            await server.send(batch)
            results_of(await server.results(batch.response_id))
        assert (await ask(server, CallRef(call_id="nightly")))["nightly"].state == "unknown"
        exact = (await ask(server, CallRef(call_id="nightly", response_id=batches[1].response_id)))["nightly"]
        assert exact.state == "finished" and exact.result is not None and exact.result.ok
    assert (tmp_path / "count").read_text() == "x\nx\n" and conn.batches.executed == 2
