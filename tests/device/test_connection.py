"""`DeviceConnection` against a scripted AIP server: a real device, real processes, real sockets.

The server here is a few lines of `websockets` that speak AIP the way the protocol rules say (the
real server is written elsewhere); it records every frame in queues the tests wait on, and can
refuse, go offline, go silent or drop the link on demand. Nothing waits on a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import ssl
import subprocess
from collections import defaultdict
from collections.abc import AsyncIterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import psutil
import pytest
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode

from tether.device.link.batch import Batch
from tether.device.link.batch_runner import BatchRunner
from tether.device.link.conn import serve as serving_module
from tether.device.link.connection import (
    DeviceConnection,
    LinkHooks,
    LinkSettings,
    RegistrationRefused,
    RetriesExhausted,
    ServerTrust,
    backoff_delay,
    make_ssl_context,
)
from tether.device.link.finished import FinishedRecord
from tether.device.link.keepalive import beat_due
from tether.device.link.outbox import Outbox
from tether.device.local import LocalDevice, build_device
from tether.device.probe import collect_profile
from tether.protocol.codec import decode_client_message, encode
from tether.protocol.messages import (
    ClientMessage,
    ClientMessageType,
    RegisterAck,
    Registration,
    ServerMessage,
    ServerMessageType,
    TaskStatus,
)
from tether.protocol.models import Command, Result, ResultStatus
from tether.tools.policy.model import default_policy

T = ClientMessageType
TOKEN = "device-secret"
WAITER = """
import os, pathlib, sys, time
d = pathlib.Path(sys.argv[1])
print("started", os.getpid(), flush=True)
while not (d / "go").exists():
    time.sleep(0.005)
with open(d / "runs", "a") as f:
    f.write("x")
print("done", flush=True)
"""


class ScriptedServer:
    """Acks registrations (or refuses them as told), answers heartbeats, records frames by type."""

    def __init__(self, *, heartbeat_interval: float = 0.2, heartbeat_timeout: float = 5.0,
                 max_frame_bytes: int = 1 << 20, ssl_context: ssl.SSLContext | None = None, port: int = 0) -> None:
        self.ack = RegisterAck(device="dev-1", heartbeat_interval=heartbeat_interval,
                               heartbeat_timeout=heartbeat_timeout, grace_period=5, max_frame_bytes=max_frame_bytes)
        self.ssl_context = ssl_context
        self.port = port  # 0: any free one
        self.frames: defaultdict[ClientMessageType, asyncio.Queue[ClientMessage]] = defaultdict(asyncio.Queue)
        self.log: list[ClientMessage] = []
        self.starts: list[int] = []  # where each registered connection's frames begin in `log`
        self.registrations: asyncio.Queue[Registration] = asyncio.Queue()
        self.refusals: list[tuple[int, str]] = []  # for the next registrations, in order
        self.http_status: HTTPStatus | None = None  # refuse the WebSocket handshake itself
        self.answer_heartbeats = True
        self.pings: asyncio.Queue[int] = asyncio.Queue()  # a WebSocket ping arrived: the connection's number
        self.ws: ServerConnection | None = None
        self.server: Server | None = None
        self.url = ""

    async def __aenter__(self) -> ScriptedServer:
        pings = self.pings
        starts = self.starts

        class Connection(ServerConnection):
            def process_event(self, event: Any) -> None:
                if isinstance(event, Frame) and event.opcode is Opcode.PING:
                    pings.put_nowait(len(starts))
                super().process_event(event)

        self.server = await serve(self._handler, "127.0.0.1", self.port, process_request=self._gate,
                                  ssl=self.ssl_context, create_connection=Connection)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"{'wss' if self.ssl_context else 'ws'}://127.0.0.1:{port}/aip"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    def _gate(self, connection: ServerConnection, request: Any) -> Any:
        if self.http_status is not None:
            return connection.respond(self.http_status, f"{self.http_status.phrase}\n")
        return None

    async def _handler(self, ws: ServerConnection) -> None:
        assert ws.request is not None and ws.request.path == "/aip"
        first = decode_client_message(await ws.recv())
        assert first.type is T.REGISTER and first.payload is not None
        refusal = self.refusals.pop(0) if self.refusals else None
        if ws.request.headers.get("Authorization") != f"Bearer {TOKEN}":
            refusal = (4401, "unauthorized: unknown device token")
        if refusal is not None:
            await ws.send(encode(ServerMessage(type=ServerMessageType.REGISTER_REFUSED, error=refusal[1])))
            await ws.close(refusal[0], refusal[1])
            return
        await ws.send(encode(ServerMessage(type=ServerMessageType.REGISTER_ACK, payload=self.ack.model_dump())))
        self.ws = ws
        self.starts.append(len(self.log))
        self.registrations.put_nowait(Registration.model_validate(first.payload))
        with contextlib.suppress(ConnectionClosed):
            async for raw in ws:
                msg = decode_client_message(raw)
                self.log.append(msg)
                self.frames[msg.type].put_nowait(msg)
                if msg.type is T.HEARTBEAT and self.answer_heartbeats:
                    await ws.send(encode(ServerMessage(type=ServerMessageType.HEARTBEAT)))

    async def next(self, kind: ClientMessageType, timeout: float = 15.0) -> ClientMessage:
        async with asyncio.timeout(timeout):
            return await self.frames[kind].get()

    async def results(self, response_id: str) -> list[ClientMessage]:
        """The COMMAND_RESULTS frames of one batch, up to its COMPLETED frame."""
        frames: list[ClientMessage] = []
        while not frames or frames[-1].status is not TaskStatus.COMPLETED:
            frame = await self.next(T.COMMAND_RESULTS)
            if frame.prev_response_id == response_id:
                frames.append(frame)
        return frames

    async def output(self, needle: str) -> ClientMessage:
        while True:
            event = await self.next(T.EVENT)
            if needle in str((event.payload or {}).get("data", {}).get("data", "")):
                return event

    async def send(self, msg: ServerMessage | str) -> None:
        assert self.ws is not None
        await self.ws.send(msg if isinstance(msg, str) else encode(msg))

    def drop(self) -> None:
        """Kill the TCP link without a closing handshake (the device process stays up)."""
        assert self.ws is not None and self.ws.transport is not None
        self.ws.transport.abort()


def command(*actions: Command, **kw: Any) -> ServerMessage:
    return ServerMessage(type=ServerMessageType.COMMAND, actions=list(actions), **kw)


def run(tmp: Path, cmd: str, *argv: str, call_id: str | None = None) -> Command:
    return Command(tool_name="shell.run", parameters={"cmd": cmd, "argv": list(argv), "cwd": str(tmp)},
                   call_id=call_id)


def results_of(frames: list[ClientMessage]) -> list[Result]:
    return [r for f in frames for r in f.action_results or []]


@pytest.fixture
def device(tmp_path: Path) -> LocalDevice:
    roots = [str(tmp_path)]
    policy = default_policy().model_copy(update={"read_roots": roots, "write_roots": roots})
    # The connection's semantics (exactly-once, outbox, stops) are what is tested here: the waiter
    # watches for a file the test creates and reports its host pid, which a sandboxed command cannot
    # (its write roots are a private overlay, its pid namespace its own). tests/attacks and
    # tests/sandbox/test_sandbox.py test the sandbox itself.
    return build_device(policy=policy, state_dir=tmp_path / "state", sandbox=False)


@pytest.fixture
def waiter(tmp_path: Path) -> Command:
    (tmp_path / "waiter.py").write_text(WAITER)
    return run(tmp_path, "python3", str(tmp_path / "waiter.py"), str(tmp_path), call_id="wait-1")


@contextlib.asynccontextmanager
async def connected(server: ScriptedServer, device: LocalDevice, **kw: Any) -> AsyncIterator[DeviceConnection]:
    kw.setdefault("settings", LinkSettings(backoff_base=0.01, backoff_cap=0.05))
    conn = DeviceConnection(device.client, server.url, kw.pop("token", TOKEN), name="dev-1", **kw)
    task = asyncio.create_task(conn.run())
    try:
        async with asyncio.timeout(15):
            await conn.connected.wait()
        yield conn
    finally:
        conn.stop()
        async with asyncio.timeout(15):
            await asyncio.gather(task, return_exceptions=True)
        await device.aclose()


async def test_register_and_one_command_is_one_completed_frame(tmp_path: Path, device: LocalDevice) -> None:
    states: list[str] = []
    hooks = LinkHooks(on_state=lambda s, c: states.append(s))
    async with ScriptedServer() as server, connected(server, device, hooks=hooks,
                                                     profile=lambda: collect_profile(device, tags=["ci"])) as conn:
        registration = await server.registrations.get()
        assert registration.name == "dev-1" and len(registration.instance_id) == 32
        assert "shell.run" in {t.name for t in registration.profile.tools} and registration.profile.tags == ["ci"]
        assert conn.registered_as == "dev-1" and conn.connections == 1 and conn.state == "registered"
        msg = command(run(tmp_path, "echo", "hello"), session_id="s-1")
        await server.send(msg)
        [frame] = await server.results(msg.response_id)
        assert frame.status is TaskStatus.COMPLETED and frame.session_id == "s-1"
        [result] = frame.action_results or []
        assert result.ok and result.result["stdout"] == "hello\n" and result.call_id == msg.actions[0].call_id
    assert states[:2] == ["connecting", "registered"] and states[-1] == "stopped"


async def test_several_commands_stream_continue_then_completed(tmp_path: Path, device: LocalDevice) -> None:
    async with ScriptedServer() as server, connected(server, device):
        msg = command(*(run(tmp_path, "echo", str(i)) for i in range(3)))
        await server.send(msg)
        frames = await server.results(msg.response_id)
        assert [f.status for f in frames] == [TaskStatus.CONTINUE, TaskStatus.CONTINUE, TaskStatus.COMPLETED]
        assert [r.result["stdout"] for r in results_of(frames)] == ["0\n", "1\n", "2\n"]


async def test_early_failure_skips_the_rest(tmp_path: Path, device: LocalDevice) -> None:
    async with ScriptedServer() as server, connected(server, device):
        msg = command(run(tmp_path, "false"), run(tmp_path, "touch", str(tmp_path / "never")))
        await server.send(msg)
        first, second = results_of(await server.results(msg.response_id))
        assert first.status is ResultStatus.FAILURE and second.status is ResultStatus.SKIPPED
        assert not (tmp_path / "never").exists()


async def test_output_streams_as_events_while_the_command_runs(tmp_path: Path, device: LocalDevice,
                                                               waiter: Command) -> None:
    async with ScriptedServer() as server, connected(server, device):
        msg = command(waiter)
        await server.send(msg)
        event = await server.output("started")
        payload = event.payload or {}
        assert payload["kind"] == "output" and payload["response_id"] == msg.response_id
        assert payload["call_id"] == "wait-1" and payload["data"]["stream"] == "stdout"
        assert server.frames[T.COMMAND_RESULTS].empty()  # still running
        (tmp_path / "go").touch()
        [result] = results_of(await server.results(msg.response_id))
        assert result.ok and "done" in result.result["stdout"]


async def test_a_dropped_link_does_not_stop_the_command_and_its_result_comes_after_reconnecting(
        tmp_path: Path, device: LocalDevice, waiter: Command) -> None:
    down = asyncio.Event()

    def hook(state: str, _: DeviceConnection) -> None:
        if state == "disconnected":
            down.set()

    async with ScriptedServer() as server, connected(server, device, hooks=LinkHooks(on_state=hook)) as conn:
        first = await server.registrations.get()
        msg = command(waiter)
        await server.send(msg)
        await server.output("started")
        server.http_status = HTTPStatus.SERVICE_UNAVAILABLE  # offline until the result is in the outbox
        server.drop()
        await down.wait()  # the device noticed: the result cannot go out on the dead link
        (tmp_path / "go").touch()
        async with asyncio.timeout(15):
            await conn.batches.idle.wait()
        assert conn.outbox.pending_call_ids() == ["wait-1"]
        server.http_status = None
        again = await server.registrations.get()
        assert again.finished_call_ids == ["wait-1"] and again.instance_id == first.instance_id
        [result] = results_of(await server.results(msg.response_id))
        assert result.ok and result.call_id == "wait-1"
        assert server.log[server.starts[-1]].type is T.COMMAND_RESULTS  # the outbox first after the new ACK
        probe = command(run(tmp_path, "true"))  # everything owed has been sent by the time this answers
        await server.send(probe)
        await server.results(probe.response_id)
        delivered = [r for f in server.log if f.type is T.COMMAND_RESULTS for r in f.action_results or []]
        assert [r.call_id for r in delivered].count("wait-1") == 1
        assert (tmp_path / "runs").read_text() == "x" and conn.connections == 2


async def test_work_no_server_waits_for_is_stopped_and_its_outcome_still_sent(tmp_path: Path, device: LocalDevice,
                                                                                waiter: Command) -> None:
    async with ScriptedServer() as server, connected(server, device) as conn:
        await server.registrations.get()
        msg = command(waiter)
        await server.send(msg)
        event = await server.output("started")
        proc = psutil.Process(int(event.payload["data"]["data"].split()[1]))  # type: ignore[index]
        server.drop()  # it comes back to a server that acks with resumed=False, as a restarted one does
        await server.registrations.get()
        async with asyncio.timeout(15):
            await conn.batches.idle.wait()  # the device stopped the batch (this loop runs it: wait here)
        _, alive = psutil.wait_procs([proc], timeout=10)
        assert alive == [] and not (tmp_path / "runs").exists()
        probe = command(run(tmp_path, "true"))  # the new session's work is not stuck behind the old
        await server.send(probe)
        [result] = results_of(await server.results(probe.response_id))
        assert result.ok and conn.batches.running == 0
        # the server records it as a late outcome (docs/outcomes.md): the command was stopped, and says why
        [stale] = [r for f in server.log if f.type is T.COMMAND_RESULTS and f.prev_response_id == msg.response_id
                   for r in f.action_results or []]
        assert stale.status is ResultStatus.FAILURE and "no longer waits" in (stale.error or "")


async def test_a_resent_batch_is_answered_from_the_record_not_run_again(tmp_path: Path, device: LocalDevice,
                                                                       waiter: Command) -> None:
    async with ScriptedServer() as server, connected(server, device) as conn:
        original = command(waiter)
        await server.send(original)
        await server.output("started")
        await server.send(original)  # the same batch again while it still runs (a resend after a reconnect)
        (tmp_path / "go").touch()
        [a] = results_of(await server.results(original.response_id))
        await server.send(original)  # and once more after it finished: answered from the record
        [b] = results_of(await server.results(original.response_id))
        assert a.ok and a == b
        assert (tmp_path / "runs").read_text() == "x" and conn.batches.executed == 1


async def test_a_call_id_reused_by_another_batch_is_a_new_call(tmp_path: Path, device: LocalDevice) -> None:
    """The record is keyed by the server's response_id and the call_id: a caller's call_id is a label,
    so another batch reusing it runs for real and never receives the first batch's result."""
    (tmp_path / "private.txt").write_text("the first caller's secret")
    async with ScriptedServer() as server, connected(server, device) as conn:
        first = command(run(tmp_path, "cat", str(tmp_path / "private.txt"), call_id="nightly-report-1"))
        await server.send(first)
        [a] = results_of(await server.results(first.response_id))
        second = command(run(tmp_path, "echo", "mine", call_id="nightly-report-1"))
        await server.send(second)
        [b] = results_of(await server.results(second.response_id))
    assert a.ok and a.result["stdout"] == "the first caller's secret"
    assert b.ok and b.result["stdout"] == "mine\n" and b.call_id == "nightly-report-1"
    assert conn.batches.executed == 2


async def test_cancel_kills_the_running_process_and_fails_the_rest(tmp_path: Path, device: LocalDevice,
                                                                  waiter: Command) -> None:
    async with ScriptedServer() as server, connected(server, device):
        msg = command(waiter, run(tmp_path, "touch", str(tmp_path / "after")))
        await server.send(msg)
        event = await server.output("started")
        proc = psutil.Process(int(event.payload["data"]["data"].split()[1]))  # type: ignore[index]
        await server.send(ServerMessage(type=ServerMessageType.CANCEL, response_id=msg.response_id))
        results = results_of(await server.results(msg.response_id))
        assert [r.status for r in results] == [ResultStatus.FAILURE] * 2
        assert all(r.error == "cancelled by the server" for r in results)
        _, alive = psutil.wait_procs([proc], timeout=10)
        assert alive == [] and not (tmp_path / "after").exists()


async def test_the_batch_timeout_kills_the_command(tmp_path: Path, device: LocalDevice, waiter: Command) -> None:
    async with ScriptedServer() as server, connected(server, device):
        # long enough for a sandboxed python3 to start and say so on a loaded machine (0.5 s was not)
        msg = command(waiter, timeout=2.5)
        await server.send(msg)
        event = await server.output("started")
        proc = psutil.Process(int(event.payload["data"]["data"].split()[1]))  # type: ignore[index]
        [result] = results_of(await server.results(msg.response_id))
        assert result.status is ResultStatus.FAILURE and "timed out after 2.5s" in (result.error or "")
        _, alive = psutil.wait_procs([proc], timeout=10)
        assert alive == []


async def test_batches_run_one_at_a_time_in_order_while_heartbeats_flow(tmp_path: Path, device: LocalDevice,
                                                                       waiter: Command) -> None:
    async with ScriptedServer(heartbeat_interval=0.05, heartbeat_timeout=1.0) as server, connected(server, device):
        first = command(waiter)
        second = command(run(tmp_path, "touch", str(tmp_path / "second")))
        third = command(run(tmp_path, "echo", "third"))
        for msg in (first, second, third):
            await server.send(msg)
        await server.output("started")
        while (await server.next(T.HEARTBEAT)).payload != {"running": 3, "queued": 2}:
            pass  # older heartbeats, from before the batches arrived
        beat = await server.next(T.HEARTBEAT)  # and they keep coming while the batch runs
        assert beat.payload == {"running": 3, "queued": 2}  # one session (none given): one runs, two wait
        await server.send(ServerMessage(type=ServerMessageType.DEVICE_INFO_REQUEST))
        info = await server.next(T.DEVICE_INFO)
        assert info.payload is not None and not (tmp_path / "second").exists()
        assert server.frames[T.COMMAND_RESULTS].empty()
        (tmp_path / "go").touch()
        order = [(await server.next(T.COMMAND_RESULTS)).prev_response_id for _ in range(3)]
        assert order == [first.response_id, second.response_id, third.response_id]


@pytest.mark.parametrize(("sent", "heard_ago", "news", "said", "due"), [
    (False, 0.1, (0, 0), (0, 0), True),  # the device said nothing since the last beat: the server needs one
    (True, 1.0, (0, 0), (0, 0), True),  # the server said nothing for an interval: its answer proves it alive
    (True, 0.1, (1, 0), (0, 0), True),  # the load changed: the server picks devices by it
    (True, 0.1, (0, 0), None, True),  # no beat yet
    (True, 0.1, (2, 1), (2, 1), False),  # frames both ways, the same load: a beat would say nothing new
])
def test_a_beat_is_sent_when_it_says_something(sent: bool, heard_ago: float, news: tuple[int, int],
                                                said: tuple[int, int] | None, due: bool) -> None:
    assert beat_due(sent, heard_ago, 1.0, news, said) is due


async def test_a_link_busy_both_ways_skips_its_beats_and_an_idle_one_beats_again(
        device: LocalDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    decisions: asyncio.Queue[tuple[tuple[Any, ...], bool]] = asyncio.Queue()

    def spy(*args: Any) -> bool:
        due = beat_due(*args)
        decisions.put_nowait((args, due))
        return due

    monkeypatch.setattr(serving_module, "beat_due", spy)
    async with ScriptedServer(heartbeat_interval=0.5, heartbeat_timeout=30) as server, connected(server, device):
        (sent, _, _, _, said), due = await decisions.get()
        assert due and not sent and said is None  # idle since registering: the first beat goes
        assert (await server.next(T.HEARTBEAT)).payload == {"running": 0, "queued": 0}
        msg = command(Command(tool_name="list_tools", parameters={"namespace": "none"}))
        await server.send(msg)  # a command in, its result out: the link is busy both ways this interval
        await server.results(msg.response_id)
        (sent, _, _, news, said), due = await decisions.get()
        # the result waits for its acknowledgement, which only a beat's answer brings (Outbox): a beat goes,
        # as if the device had said nothing, though the link was busy both ways
        assert due and not sent and news == said == (0, 0)
        assert (await server.next(T.HEARTBEAT)).payload == {"running": 0, "queued": 0}
        (sent, _, _, _, _), due = await decisions.get()  # a quiet interval: beating again
        assert due and not sent
        assert (await server.next(T.HEARTBEAT)).payload == {"running": 0, "queued": 0}


async def test_a_silent_server_is_noticed_and_the_device_reconnects(device: LocalDevice) -> None:
    async with ScriptedServer(heartbeat_interval=0.05, heartbeat_timeout=0.3) as server, \
            connected(server, device) as conn:
        first = await server.registrations.get()
        await server.next(T.HEARTBEAT)
        server.answer_heartbeats = False
        again = await server.registrations.get()
        await conn.connected.wait()  # the device has read the new ACK
        assert again.instance_id == first.instance_id and conn.connections == 2
        assert "nothing from the server" in (conn.last_error or "")


async def test_unauthorized_stops_run_with_the_servers_reason(device: LocalDevice) -> None:
    async with ScriptedServer() as server:
        conn = DeviceConnection(device.client, server.url, "wrong-token", settings=LinkSettings(backoff_base=0.01))
        with pytest.raises(RegistrationRefused) as info:
            await asyncio.wait_for(conn.run(), 15)
        assert info.value.code == 4401 and info.value.fatal
        assert "unknown device token" in str(info.value) and conn.state == "refused"


async def test_http_level_refusal_is_fatal_too(device: LocalDevice) -> None:
    async with ScriptedServer() as server:
        server.http_status = HTTPStatus.UNAUTHORIZED
        conn = DeviceConnection(device.client, server.url, TOKEN, settings=LinkSettings(backoff_base=0.01))
        with pytest.raises(RegistrationRefused, match="HTTP 401"):
            await asyncio.wait_for(conn.run(), 15)


async def test_duplicate_device_is_retried(device: LocalDevice) -> None:
    async with ScriptedServer() as server:
        server.refusals = [(4409, "dev-1 is already connected"), (4409, "dev-1 is already connected")]
        async with connected(server, device) as conn:
            assert conn.connections == 1 and "4409" in (conn.last_error or "")
            assert server.refusals == []


async def test_max_attempts_gives_up(device: LocalDevice, free_port: int) -> None:
    conn = DeviceConnection(device.client, f"ws://127.0.0.1:{free_port}/aip", TOKEN,
                            settings=LinkSettings(backoff_base=0.001, max_attempts=3))
    with pytest.raises(RetriesExhausted, match="3 failed attempt"):
        await asyncio.wait_for(conn.run(), 15)


async def test_bad_frames_get_an_error_reply_and_the_link_stays(tmp_path: Path, device: LocalDevice) -> None:
    async with ScriptedServer(max_frame_bytes=4096) as server, connected(server, device) as conn:
        await server.send("this is not json")
        assert "not_json" in ((await server.next(T.ERROR)).error or "")
        await server.send('{"type": "command", "actions": []}')
        assert "invalid" in ((await server.next(T.ERROR)).error or "")
        await server.send(encode(command(run(tmp_path, "echo", "x" * 5000))))
        assert "too_large" in ((await server.next(T.ERROR)).error or "")
        msg = command(run(tmp_path, "echo", "still here"))
        await server.send(msg)
        [result] = results_of(await server.results(msg.response_id))
        assert result.ok and conn.connections == 1


async def test_a_result_too_large_for_a_frame_becomes_a_failure(tmp_path: Path, device: LocalDevice) -> None:
    (tmp_path / "big.py").write_text("print('y' * 20000)\n")
    async with ScriptedServer(max_frame_bytes=8192) as server, connected(server, device):
        msg = command(run(tmp_path, "python3", str(tmp_path / "big.py")))
        await server.send(msg)
        [result] = results_of(await server.results(msg.response_id))
        assert result.status is ResultStatus.FAILURE and "too large" in (result.error or "")


def test_backoff_is_exponential_with_full_jitter_under_a_cap() -> None:
    assert [backoff_delay(n, 0.5, 30.0, rand=lambda: 1.0) for n in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert backoff_delay(10_000, 0.5, 30.0, rand=lambda: 1.0) == 30.0
    assert backoff_delay(5, 0.5, 30.0, rand=lambda: 0.0) == 0.0
    rng = random.Random(7)
    samples = {n: [backoff_delay(n, 0.5, 30.0, rand=rng.random) for _ in range(2000)] for n in (0, 3, 20)}
    assert all(0 <= s <= min(30.0, 0.5 * 2**n) for n, xs in samples.items() for s in xs)
    means = [sum(xs) / len(xs) for xs in samples.values()]
    assert means[0] < means[1] < means[2] <= 30.0 and len(set(samples[20])) > 1900  # jittered, not lockstep
    with pytest.raises(ValueError):
        backoff_delay(-1)


def test_ssl_context_verifies_by_default(tmp_path: Path) -> None:
    assert make_ssl_context("ws://127.0.0.1:1/aip") is None
    ctx = make_ssl_context("wss://example.org/aip")
    assert ctx is not None and ctx.verify_mode is ssl.CERT_REQUIRED and ctx.check_hostname
    with pytest.raises(ValueError, match="not a wss"):
        make_ssl_context("ws://127.0.0.1:1/aip", ca_file="ca.pem")
    with pytest.raises(ValueError, match="ws:// or wss://"):
        make_ssl_context("http://127.0.0.1:1/aip")


def test_a_url_that_is_not_a_websocket_url_is_refused_up_front(device: LocalDevice) -> None:
    for url in ("http://127.0.0.1:8765/aip", "127.0.0.1:8765", "ws://127.0.0.1:notaport/aip"):
        with pytest.raises(ValueError, match="ws"):
            DeviceConnection(device.client, url, TOKEN)


async def test_wss_with_a_self_signed_certificate(tmp_path: Path, device: LocalDevice) -> None:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not on PATH; install it with `apt-get install openssl`")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    async with ScriptedServer(ssl_context=server_ctx) as server:
        untrusted = DeviceConnection(device.client, server.url, TOKEN, settings=LinkSettings(max_attempts=1))
        with pytest.raises(RetriesExhausted, match="CERTIFICATE_VERIFY_FAILED"):
            await asyncio.wait_for(untrusted.run(), 15)
        ctx = make_ssl_context(server.url, ca_file=str(cert))
        async with connected(server, device, trust=ServerTrust(ssl_context=ctx)) as conn:
            msg = command(run(tmp_path, "echo", "over tls"))
            await server.send(msg)
            [result] = results_of(await server.results(msg.response_id))
            assert result.ok and conn.connections == 1


async def test_stop_cancels_running_work_and_says_so(tmp_path: Path, device: LocalDevice, waiter: Command) -> None:
    async with ScriptedServer() as server:
        conn = DeviceConnection(device.client, server.url, TOKEN, settings=LinkSettings(backoff_base=0.01))
        task = asyncio.create_task(conn.run())
        await server.registrations.get()
        msg = command(waiter, run(tmp_path, "echo", "later"))
        await server.send(msg)
        event = await server.output("started")
        proc = psutil.Process(int(event.payload["data"]["data"].split()[1]))  # type: ignore[index]
        conn.stop()
        results = results_of(await server.results(msg.response_id))
        assert results[0].error.startswith("outcome unknown: the command was running when the device shut down")
        assert results[1].error == "not run: the device is shutting down"
        await asyncio.wait_for(task, 15)
        _, alive = psutil.wait_procs([proc], timeout=10)
        assert alive == [] and conn.state == "stopped" and not conn.connected.is_set()
        await device.aclose()


async def test_emit_from_a_worker_thread_reaches_the_server(device: LocalDevice) -> None:
    async with ScriptedServer() as server, connected(server, device) as conn:
        emit = conn.batches.emitter(Batch(command(Command(tool_name="noop"), response_id="r-1")))
        await asyncio.to_thread(emit, "progress", {"call_id": "c-1", "percent": 50})
        event = await server.next(T.EVENT)
        assert event.payload == {"kind": "progress", "response_id": "r-1", "call_id": "c-1",
                                 "data": {"call_id": "c-1", "percent": 50}}


def test_outbox_keeps_results_across_a_disconnect_and_bounds_events() -> None:
    outbox = Outbox(max_events=2)
    event = ClientMessage(type=T.EVENT, payload={"kind": "output"})
    outbox.put_event(event)  # not connected: output nobody can see is dropped
    assert len(outbox) == 0 and outbox.dropped_events == 1
    outbox.put_result("r1", "c1")
    outbox.open(max_bytes=1 << 20)
    for _ in range(3):
        outbox.put_event(event)  # the oldest gives way, results never do
    outbox.put_result("r2", "c2")
    assert outbox.pending_call_ids() == ["c1", "c2"] and outbox.dropped_events == 2
    kinds = []
    while (frame := outbox.pop()) is not None:
        kinds.append(frame[0] if frame[0] == "result" else (frame[0], frame[1].count("events_dropped")))
    assert kinds == ["result", ("event", 0), ("event", 0), "result", ("event", 1)]
    outbox.put_result("r3", "c3")
    outbox.put_event(event)
    outbox.close()
    assert outbox.pending_call_ids() == ["c3"] and len(outbox) == 1


def test_finished_record_forgets_the_oldest() -> None:
    record = FinishedRecord(limit=2)
    for call_id in ("a", "b", "c"):
        record.add(call_id, Result(status=ResultStatus.SUCCESS, call_id=call_id))
    assert "a" not in record and "b" in record and record.get("c") is not None and len(record) == 2


async def test_a_batch_cancelled_before_its_task_first_runs_is_answered_and_the_runner_goes_on(
        tmp_path: Path, device: LocalDevice) -> None:
    outbox = Outbox()
    outbox.open(1 << 20)
    runner = BatchRunner(device.client, outbox, FinishedRecord(), client_id="dev-1")
    try:
        first = command(run(tmp_path, "true", call_id="never-1"))
        runner.submit(first)  # its task exists but has not taken a step yet
        assert runner.cancel(first.response_id)  # in the same turn: the task is cancelled before it starts
        second = command(run(tmp_path, "true", call_id="then-2"))
        runner.submit(second)
        async with asyncio.timeout(15):
            await runner.idle.wait()
        assert outbox.pending_call_ids() == ["never-1", "then-2"]
        recorded = runner.record.get((second.response_id, "then-2"))
        assert recorded is not None and recorded.ok and runner.record.get("then-2") is None
    finally:
        await device.aclose()
