"""A device comes back inside the grace period it was given, and its results reach callers still waiting.

Issue 10, item 6: a link cut at +1.5 s and restored at +8 s failed commands that had succeeded,
because the device's exponential backoff had grown past the server's 10 s grace period. Here the
same timeline runs scaled down against real processes (server, devices, sandboxed shell commands)
through a loopback proxy that refuses connections while the link is "down"; the schedule itself is
checked as a pure function; and the hub's rules at the end of a grace period are checked from the
outside with a scripted device.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random

import pytest

from tests.kits import db as dbkit
from tests.kits.aip import WAIT, FakeDevice, ServerFactory, logged, ok
from tests.kits.netutil import Cluster, TcpProxy, wait_for, workspace_policy
from tether.device.link.reconnect import GRACE_FLOOR_S, GRACE_SHARE, attempt_timeout, backoff_delay
from tether.protocol.messages import ServerMessageType
from tether.protocol.models import Command, ResultStatus
from tether.server.store import Store

# ------------------------------------------------------------------ the schedule (pure)


def test_without_a_grace_window_the_backoff_is_the_plain_capped_exponential():
    assert [backoff_delay(n, 0.5, 30.0, rand=lambda: 1.0) for n in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert backoff_delay(3, 0.5, 30.0, rand=lambda: 0.5) == 2.0
    for left in (None, 0.0, -1.0):  # no window, or one that has closed: the same schedule
        assert backoff_delay(9, 0.5, 30.0, rand=lambda: 1.0, grace_left=left) == 30.0
    with pytest.raises(ValueError):
        backoff_delay(-1)


def test_inside_a_grace_window_no_wait_exceeds_a_share_of_what_is_left():
    top = lambda: 1.0  # noqa: E731 - the largest delay the jitter can pick
    assert backoff_delay(20, 0.5, 30.0, rand=top, grace_left=10.0) == pytest.approx(GRACE_SHARE * 10.0)
    assert backoff_delay(20, 0.5, 30.0, rand=top, grace_left=2.0) == pytest.approx(GRACE_SHARE * 2.0)
    assert backoff_delay(20, 0.5, 30.0, rand=top, grace_left=0.01) == GRACE_FLOOR_S  # never a busy loop
    assert backoff_delay(0, 0.5, 30.0, rand=top, grace_left=10.0) == 0.5  # early attempts stay as short as ever
    assert backoff_delay(20, 0.5, 30.0, rand=lambda: 0.5, grace_left=8.0) == pytest.approx(GRACE_SHARE * 4.0)


@pytest.mark.parametrize("seed", range(20))
def test_a_server_back_before_the_window_closes_is_found_inside_it(seed):
    """Simulate the device's loop: whatever the jitter, and however many attempts failed before the
    link went down, once the server is reachable the next attempt comes while the window is open."""
    rand = random.Random(seed).random
    grace = 10.0
    for restored in (1.0, 5.0, 8.0, 9.0, 9.5):
        now, attempt = 0.0, 12  # a long outage before this one: the plain schedule would wait up to 30 s
        while now < restored:  # attempts while the link is down fail at once
            now += backoff_delay(attempt, 0.5, 30.0, rand, grace_left=grace - now)
            attempt += 1
        assert now <= restored + max(GRACE_FLOOR_S, GRACE_SHARE * (grace - restored))
        assert now < grace, f"link back at {restored}s, next attempt at {now:.2f}s of a {grace}s grace"


def test_one_attempt_may_not_use_up_the_window():
    assert attempt_timeout(10.0, None) == 10.0
    assert attempt_timeout(10.0, 0.0) == 10.0
    assert attempt_timeout(10.0, 8.0) == 4.0
    assert attempt_timeout(10.0, 0.5) == 1.0  # but long enough for a handshake
    assert attempt_timeout(2.0, 30.0) == 2.0


# ------------------------------------------------------------------ the hub at the end of a grace period


@pytest.fixture
async def servers(tmp_path):
    factory = ServerFactory(tmp_path)
    yield factory
    await factory.stop_all()


async def _until(condition, what: str) -> None:
    """Wait for this process's own server to reach a state no event announces (yielding to it, never
    sleeping; bounded by WAIT)."""
    async with asyncio.timeout(WAIT):
        while not condition():
            await asyncio.sleep(0)
    assert condition(), what


async def test_a_device_registering_as_its_grace_ends_keeps_its_batch(servers):
    srv = await servers.start(grace_period=WAIT * 10)
    token = srv.token("laptop")
    dev = FakeDevice(srv.url, token, name="laptop")
    await dev.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands(
        [Command(tool_name="work", parameters={})], timeout=WAIT * 2))
    sent = await dev.expect(ServerMessageType.COMMAND)
    dev.abort()
    assert await srv.hub.registry.wait_until(lambda: srv.hub.registry.get("laptop").status == "offline", WAIT)
    back = FakeDevice(srv.url, token, name="laptop", instance_id=dev.instance_id)
    await back.connect()  # authenticated: the device is on its way back
    await _until(lambda: "laptop" in srv.hub._arriving, "the registration is under way")
    srv.hub._grace_expired("laptop")  # the grace period ends right now, before its REGISTER frame is read
    assert not run.done()
    ack = await back.register()
    assert ack.type is ServerMessageType.REGISTER_ACK and ack.payload["resumed"] is True
    resent = await back.expect(ServerMessageType.COMMAND)
    assert resent.response_id == sent.response_id
    await back.results(sent.response_id, [ok(c) for c in sent.actions])
    [result] = await run
    assert result.ok, result.error


async def test_a_registration_that_fails_after_the_grace_ended_gives_the_batch_up(servers):
    srv = await servers.start(grace_period=WAIT * 10, register_timeout=0.2)
    token = srv.token("laptop")
    dev = FakeDevice(srv.url, token, name="laptop")
    await dev.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands(
        [Command(tool_name="work", parameters={})], timeout=WAIT * 2))
    await dev.expect(ServerMessageType.COMMAND)
    dev.abort()
    assert await srv.hub.registry.wait_until(lambda: srv.hub.registry.get("laptop").status == "offline", WAIT)
    silent = FakeDevice(srv.url, token, name="laptop", instance_id=dev.instance_id)
    await silent.connect()
    await _until(lambda: "laptop" in srv.hub._arriving, "the registration is under way")
    srv.hub._grace_expired("laptop")
    # it never sends REGISTER: refused after register_timeout, and then the grace's end takes effect
    [result] = await asyncio.wait_for(run, WAIT)
    assert result.outcome_pending and "grace period" in result.error
    assert not srv.hub._arriving


async def test_after_the_grace_the_device_is_told_its_batches_are_no_longer_awaited(servers, caplog):
    srv = await servers.start(grace_period=0.2)
    token = srv.token("laptop")
    dev = FakeDevice(srv.url, token, name="laptop")
    await dev.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands(
        [Command(tool_name="work", parameters={})], timeout=WAIT))
    sent = await dev.expect(ServerMessageType.COMMAND)
    dev.abort()
    [result] = await asyncio.wait_for(run, WAIT)
    assert "did not come back within the 0.2s grace period" in result.error
    back = FakeDevice(srv.url, token, name="laptop", instance_id=dev.instance_id)
    ack = await back.register()
    # not resumed: the device stops what it still runs for that batch instead of working for nobody
    assert ack.type is ServerMessageType.REGISTER_ACK and ack.payload["resumed"] is False
    with caplog.at_level(logging.WARNING, logger="tether.server.hub"):
        await back.results(sent.response_id, [ok(c) for c in sent.actions])
        await back.sync()
        await logged(caplog, f"late results from device laptop for batch {sent.response_id} recorded")
    [row] = srv.store.audit.batch(sent.response_id)  # the outcome is a fact, however late
    assert row["status"] == "success" and row["error"].startswith("late:"), row
    # and it is this device again for everything new
    again = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands(
        [Command(tool_name="next", parameters={})], timeout=WAIT))
    await back.answer_one()
    assert (await again)[0].ok


# ------------------------------------------------------------------ real processes, the timeline


class SwitchedProxy(TcpProxy):
    """A `TcpProxy` whose link can be down: live connections are cut and new ones refused until `up()`."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.is_down = False
        self.refused = 0
        self.refused_twice = asyncio.Event()  # the devices kept trying while the link was down
        self._handlers: set[asyncio.Task] = set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_down:
            self.refused += 1
            if self.refused >= 2:
                self.refused_twice.set()
            writer.transport.abort()
            return
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            await super()._handle(reader, writer)
        finally:
            self._handlers.discard(task)

    async def aclose(self) -> None:
        await super().aclose()
        self.cut()  # a connection accepted while closing
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=WAIT)

    def down(self) -> None:
        self.is_down = True
        self.cut()

    def up(self) -> None:
        self.is_down = False



@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


async def test_link_cut_while_commands_run_and_restored_inside_the_grace_loses_nothing(cluster, tmp_path):
    proxy = await SwitchedProxy(cluster.port).start()
    live = tmp_path / "live"
    live.mkdir()
    # marks must be seen while a command runs: a live write root
    policy = workspace_policy(tmp_path, live_write_roots=[str(live)])
    devices = {name: cluster.device(name, port=proxy.port, extra=("--policy", str(policy)))
               for name in ("alpha", "beta")}
    for name, proc in devices.items():
        await asyncio.to_thread(cluster.wait_online, name, proc)
    script = tmp_path / "work.py"
    script.write_text(  # marks its start and its end; holds until the test opens its gate (a FIFO)
        "import pathlib, sys\n"
        f"live = pathlib.Path({str(live)!r})\n"
        "label = sys.argv[1]\n"
        "(live / (label + '.ran')).open('a').write('ran\\n')\n"
        "(live / (label + '.gate')).open().readline()\n"
        "(live / (label + '.done')).write_text('done')\n"
        "print('done', label)\n")
    labels = {"alpha": ["a1", "a2"], "beta": ["b1", "b2"]}  # two batches each: a device runs them in turn
    for names in labels.values():
        for label in names:
            os.mkfifo(live / f"{label}.gate")
    commands = {label: Command(tool_name="shell.run", parameters={"cmd": "python3", "argv": [str(script), label],
                                                                  "cwd": str(tmp_path)})
                for names in labels.values() for label in names}
    calls = {label: asyncio.ensure_future(asyncio.to_thread(cluster.remote.run, device, [commands[label]],
                                                            timeout=60))
             for device, names in labels.items() for label in names}
    def running(device: str) -> bool:  # its two batches reach it in either order
        finished = {label: call.result() for label, call in calls.items() if call.done()}
        assert not finished, f"finished before the link was cut: {finished}"
        return any((live / f"{label}.ran").exists() for label in labels[device])

    await asyncio.to_thread(wait_for, lambda: running("alpha") and running("beta"), "the first commands run", 30)
    proxy.down()  # the fault: the link is cut while commands run, down until the devices were refused twice
    # each gate is held open for reading and writing here (which never blocks), so the line waits in
    # the FIFO for a command that opens it later (a2 and b2 start after a1 and b1)
    gates = [os.open(live / f"{label}.gate", os.O_RDWR) for label in commands]
    for fd in gates:
        os.write(fd, b"open\n")
    await asyncio.to_thread(wait_for, lambda: all((live / f"{label}.done").exists() for label in commands),
                            "every command finished on its device while the link is down", 30)
    early = {label: call.result() for label, call in calls.items() if call.done()}
    assert not early, f"answered while the link was down: {early}"
    # the outage lasts until the devices have been refused twice: they kept trying while it was down
    await asyncio.wait_for(proxy.refused_twice.wait(), WAIT)
    assert proxy.refused >= 2, "the devices kept trying while the link was down"
    proxy.up()
    outcomes = {label: await call for label, call in calls.items()}
    for fd in gates:
        os.close(fd)
    await proxy.aclose()
    for label, (device, [result]) in outcomes.items():
        assert result.status is ResultStatus.SUCCESS, f"{label} on {device}: {result.error}"
        assert result.call_id == commands[label].call_id
        assert result.result["stdout"] == f"done {label}\n"
        assert (live / f"{label}.ran").read_text() == "ran\n", f"{label} ran exactly once"
    log = cluster.server.output()
    assert "refused results" not in log and "grace period" not in log, log
    # a result may arrive twice (the outbox's copy, then the record's answer to the re-sent batch): the
    # second is logged and dropped; nothing else may come late
    delivered = {c.call_id for c in commands.values()}
    for line in log.splitlines():
        if "late results" in line:
            assert any(call_id in line for call_id in delivered), line
    store = Store(str(dbkit.server_db(cluster.db)))

    def audited() -> list[dict]:  # the server writes its audit rows soon after answering, not before
        rows = [r for r in store.audit.rows(limit=1000) if r["tool_name"] == "shell.run"]
        return rows if len(rows) >= len(commands) else []

    try:
        rows = await asyncio.to_thread(wait_for, audited, "the audit rows", 30)
    finally:
        store.close()
    assert sorted(r["call_id"] for r in rows) == sorted(c.call_id for c in commands.values())
    assert {r["status"] for r in rows} == {"success"}
    for proc in devices.values():
        assert "registered as" in proc.output() and proc.popen.poll() is None
