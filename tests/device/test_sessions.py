"""Several callers at once on one real device process (issue 14, section 3).

Long commands are Python scripts that print `started LABEL` and then block on a FIFO gate the test
opens; the test learns that a command runs from its streamed `output` event, never from a sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.kits.netutil import CLI, Cluster, wait_for
from tether.client.rest import RemoteServer
from tether.protocol.messages import Event
from tether.protocol.models import Command, Result, ResultStatus

SCRIPT = (
    "import pathlib, sys\n"
    "gate = pathlib.Path(sys.argv[1])\n"
    "print('started', gate.stem, flush=True)\n"
    "gate.open().readline()\n"
    "print('done', gate.stem)\n"
)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


class Caller:
    """One REST caller in a thread of its own (its own HTTP client), with its events seen as they come."""

    def __init__(self, cluster: Cluster, session: str, command: Command, timeout: float = 60) -> None:
        self.session = session
        self.command = command
        self.events: list[Event] = []
        self.started = threading.Event()
        self.queued = threading.Event()
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._args = (cluster, timeout)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _on_event(self, event: Event) -> None:
        self.events.append(event)
        if event.kind == "output" and "started" in str(event.data.get("data", "")):
            self.started.set()
        if event.kind == "queued":
            self.queued.set()

    def _run(self) -> None:
        cluster, timeout = self._args
        try:
            with RemoteServer(f"http://127.0.0.1:{cluster.port}", cluster.api_token) as remote:
                _, [self.result] = remote.run("alpha", [self.command], timeout=timeout, session_id=self.session,
                                              on_event=self._on_event)
        except BaseException as exc:  # reported by the test's assertions
            self.error = exc
        finally:
            self.finished.set()

    def outcome(self, timeout: float = 30) -> Result:
        assert self.finished.wait(timeout), f"session {self.session}: no answer within {timeout}s"
        assert self.error is None, f"session {self.session}: {self.error!r}"
        assert self.result is not None
        return self.result


def _setup(cluster: Cluster, tmp_path: Path, max_sessions: int) -> tuple[Path, Path, Any]:
    live = tmp_path / "live"
    live.mkdir()
    policy = tmp_path / "policy.yaml"  # the gates must be the test's own FIFOs: a live write root
    # the script and the commands' cwd lie in the test's directory: a write root of its own (the rest of the temp
    # dir is each session's private /tmp)
    roots = json.dumps(["~", tempfile.gettempdir(), str(tmp_path)])
    policy.write_text(f"live_write_roots: [{str(live)!r}]\nmax_concurrent_sessions: {max_sessions}\n"
                      f"write_roots: {roots}\n")
    device = cluster.device("alpha", extra=("--policy", str(policy)))
    cluster.wait_online("alpha", device)
    script = tmp_path / "gated.py"
    script.write_text(SCRIPT)
    return live, script, device


def _gated(live: Path, script: Path, label: str, tmp_path: Path) -> tuple[Command, Path]:
    gate = live / f"{label}.gate"
    os.mkfifo(gate)
    return Command(tool_name="shell.run", parameters={"cmd": "python3", "argv": [str(script), str(gate)],
                                                      "cwd": str(tmp_path)}), gate


def _echo(text: str, tmp_path: Path) -> Command:
    return Command(tool_name="shell.run", parameters={"cmd": "echo", "argv": [text], "cwd": str(tmp_path)})


def _open(gate: Path) -> int:
    """Hold the gate open for reading and writing (never blocks) and put the line its command waits for."""
    fd = os.open(gate, os.O_RDWR)
    os.write(fd, b"go\n")
    return fd


def test_sessions_run_side_by_side_in_order_each_and_wait_in_line_beyond_the_limit(cluster, tmp_path):
    live, script, _ = _setup(cluster, tmp_path, max_sessions=3)
    fds: list[int] = []
    try:
        (cmd1, gate1), (cmd2, gate2) = _gated(live, script, "s1", tmp_path), _gated(live, script, "s2", tmp_path)
        one, two = Caller(cluster, "s1", cmd1), Caller(cluster, "s2", cmd2)
        assert one.started.wait(30) and two.started.wait(30), "two long commands of two sessions run at once"
        # within a session, order: s2's second batch waits for its first
        two_later = Caller(cluster, "s2", _echo("after s2", tmp_path))
        # a third session's quick command answers while both long ones hold their slots
        quick = Caller(cluster, "s3", _echo("quick", tmp_path)).outcome()
        assert quick.status is ResultStatus.SUCCESS and quick.result["stdout"] == "quick\n", quick.error
        # a tools listing never waits, not even inside a session whose command is running
        with RemoteServer(f"http://127.0.0.1:{cluster.port}", cluster.api_token) as remote:
            _, [listing] = remote.run("alpha", [Command(tool_name="list_tools", tool_type="data_collection")],
                                      timeout=10, session_id="s1")
            assert listing.status is ResultStatus.SUCCESS, listing.error
            assert any(t["name"] == "shell.run" or t.get("namespace") == "shell" for t in listing.result)
        assert not two_later.finished.is_set(), "s2's second batch ran before its first finished"
        # the third slot taken by s4: s5 waits in line and is told so
        cmd4, gate4 = _gated(live, script, "s4", tmp_path)
        four = Caller(cluster, "s4", cmd4)
        assert four.started.wait(30)
        five = Caller(cluster, "s5", _echo("fifth", tmp_path))
        assert five.queued.wait(30), "a session beyond the limit is told it waits"
        [queued] = [e for e in five.events if e.kind == "queued"]
        assert queued.data["position"] == 1 and queued.data["max_concurrent_sessions"] == 3
        assert not five.finished.is_set()

        def counts() -> bool:  # the device reports them in its heartbeat; `tether devices` shows them
            out = subprocess.run([*CLI, "devices", "--json"], capture_output=True, text=True, timeout=30,
                                 env={**cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{cluster.port}",
                                      "TETHER_TOKEN": cluster.api_token})
            [row] = [r for r in json.loads(out.stdout) if r["name"] == "alpha"]
            return row["running"] == 3 and row["queued"] == 2  # s2's second batch and s5

        wait_for(counts, "running 3 / queued 2 in `tether devices`", 30)
        fds.append(_open(gate1))  # s1 ends: its slot goes to s5
        first = one.outcome()
        assert first.status is ResultStatus.SUCCESS and first.result["stdout"] == "started s1\ndone s1\n"
        assert five.outcome().result["stdout"] == "fifth\n"
        assert not two_later.finished.is_set()
        fds.append(_open(gate2))
        assert two.outcome().result["stdout"] == "started s2\ndone s2\n"
        assert two_later.outcome().result["stdout"] == "after s2\n"
        fds.append(_open(gate4))
        assert four.outcome().status is ResultStatus.SUCCESS
    finally:
        for gate in live.glob("*.gate"):  # nothing is left blocked whatever failed
            fds.append(_open(gate))
        for fd in fds:
            os.close(fd)


def test_exec_timeout_is_wall_time_even_when_the_device_is_busy(cluster, tmp_path):
    """`tether exec --timeout 3` on a device already running another session's long command: the
    tools lookup does not wait behind it, and the whole call ends within the caller's 3 s (+ slack)."""
    live, script, _ = _setup(cluster, tmp_path, max_sessions=4)
    cmd, gate = _gated(live, script, "busy", tmp_path)
    busy = Caller(cluster, "other", cmd)
    fd: int | None = None
    try:
        assert busy.started.wait(30)
        env = {**cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{cluster.port}", "TETHER_TOKEN": cluster.api_token}
        proc = subprocess.Popen([*CLI, "exec", "--device", "alpha", "--timeout", "3", "shell.run", "cmd=sleep",
                                 'argv=["30"]', f"cwd={tmp_path}"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            # an upper bound only: the CLI's own start (seconds on a loaded 2-core machine), its 3 s, and the
            # batch's margin; waiting behind the busy command or the 30 s sleep would take far longer
            out, err = proc.communicate(timeout=3 + 6)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail("tether exec --timeout 3 was still running after 9 s")
        assert proc.returncode == 1, (out, err)
        assert "timed out" in out + err and "Traceback" not in err
        assert not busy.finished.is_set(), "the other session's command kept running"
    finally:
        fd = _open(gate)
        busy.outcome()
        os.close(fd)


async def test_the_line_moves_up_when_a_waiting_batch_is_cancelled_and_when_the_limit_grows(tmp_path):
    """`BatchRunner` alone, on a real device (unsandboxed: only the scheduling is under test): one slot,
    session a holds it on a gate; b and c wait at places 1 and 2; b is cancelled, so c is told it is
    now 1; a larger limit (a policy change) starts c at once while a still runs."""
    from tether.device.link.batch_runner import BatchRunner
    from tether.device.link.finished import FinishedRecord
    from tether.device.link.outbox import Outbox
    from tether.device.local import build_device
    from tether.protocol.codec import decode_client_message
    from tether.protocol.messages import ClientMessageType, ServerMessage, ServerMessageType
    from tether.tools.policy.model import default_policy

    roots = [str(tmp_path)]
    device = build_device(policy=default_policy().model_copy(update={"read_roots": roots, "write_roots": roots}),
                          state_dir=tmp_path / "state", sandbox=False)
    outbox = Outbox()
    outbox.open(1 << 20)
    outbox.accepting_events = True
    runner = BatchRunner(device.client, outbox, FinishedRecord(), client_id="dev", max_concurrent_sessions=1)
    script = tmp_path / "gated.py"
    script.write_text(SCRIPT)
    cmd, gate = _gated(tmp_path, script, "a", tmp_path)
    seen: list[Any] = []

    async def until(check: Any) -> Any:
        """The first frame from the outbox that passes `check`, waiting on the outbox's own event."""
        async with asyncio.timeout(30):
            while True:
                while (frame := outbox.pop()) is not None:
                    msg = decode_client_message(frame[1], 1 << 30)
                    seen.append(msg)
                    if check(msg):
                        return msg
                outbox.ready.clear()
                await outbox.ready.wait()

    def batch(session: str, command: Command) -> ServerMessage:
        return ServerMessage(type=ServerMessageType.COMMAND, actions=[command], session_id=session, timeout=60)

    def event(kind: str, response_id: str, text: str = "") -> Any:
        return lambda m: (m.type is ClientMessageType.EVENT and m.payload["kind"] == kind
                          and m.payload["response_id"] == response_id and text in str(m.payload["data"]))

    def results(response_id: str) -> Any:
        return lambda m: m.type is ClientMessageType.COMMAND_RESULTS and m.prev_response_id == response_id

    a, b, c = batch("a", cmd), batch("b", _echo("b", tmp_path)), batch("c", _echo("c", tmp_path))
    fd: int | None = None
    try:
        runner.submit(a)
        await until(event("output", a.response_id, "started"))
        runner.submit(b)
        runner.submit(c)
        assert (await until(event("queued", b.response_id))).payload["data"]["position"] == 1
        assert (await until(event("queued", c.response_id))).payload["data"]["position"] == 2
        assert (runner.started, runner.queued) == (1, 2)
        assert runner.cancel(b.response_id)
        [cancelled] = (await until(results(b.response_id))).action_results
        assert cancelled.status is ResultStatus.FAILURE and "cancelled" in cancelled.error
        assert (await until(event("queued", c.response_id))).payload["data"]["position"] == 1
        runner.set_limit(2)
        [quick] = (await until(results(c.response_id))).action_results
        assert quick.status is ResultStatus.SUCCESS and quick.result["stdout"] == "c\n"
        assert runner.started == 1 and not any(m.type is ClientMessageType.COMMAND_RESULTS
                                               and m.prev_response_id == a.response_id for m in seen)
        # a batch whose timeout runs out while it waits in line ends then, and nothing of it runs
        runner.set_limit(1)
        late = ServerMessage(type=ServerMessageType.COMMAND, actions=[_echo("late", tmp_path)], session_id="d",
                             timeout=0.2)
        runner.submit(late)
        [expired] = (await until(results(late.response_id))).action_results
        assert expired.status is ResultStatus.FAILURE and "waiting in line" in expired.error, expired.error
        assert runner.queued == 0
        fd = _open(gate)
        [long] = (await until(results(a.response_id))).action_results
        assert long.status is ResultStatus.SUCCESS and long.result["stdout"] == "started a\ndone a\n"
        await asyncio.wait_for(runner.idle.wait(), 30)
        assert runner.executed == 2  # b never ran
    finally:
        if fd is None:
            fd = _open(gate)
        await runner.abort_all(timeout=10)
        os.close(fd)
        await device.aclose()


def test_exec_says_it_waits_in_line_then_runs(cluster, tmp_path):
    live, script, _ = _setup(cluster, tmp_path, max_sessions=1)
    cmd, gate = _gated(live, script, "hold", tmp_path)
    holder = Caller(cluster, "holder", cmd)
    fd: int | None = None
    try:
        assert holder.started.wait(30)
        env = {**cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{cluster.port}", "TETHER_TOKEN": cluster.api_token}
        proc = subprocess.Popen([*CLI, "exec", "--device", "alpha", "shell.run", "cmd=echo", 'argv=["queued"]',
                                 f"cwd={tmp_path}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()  # the event itself, streamed while the command waits
            assert line == "waiting: the device is busy; number 1 in line\n", line
            assert proc.poll() is None
            fd = _open(gate)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0 and "queued" in out, out + err
    finally:
        if fd is None:
            fd = _open(gate)
        holder.outcome()
        os.close(fd)


def test_the_line_takes_turns_between_sessions():
    """`SessionLine` alone: a session with many batches does not keep its slot while another waits."""
    from dataclasses import dataclass

    from tether.device.link.session_line import SessionLine

    @dataclass(eq=False)
    class B:
        name: str
        session: str
        done: bool = False
        position: int = 0

    line: SessionLine[B] = SessionLine(1)
    a1, a2, a3, b1, c1 = B("a1", "a"), B("a2", "a"), B("a3", "a"), B("b1", "b"), B("c1", "c")
    for batch in (a1, a2, a3, b1, c1):
        line.add(batch)
    assert line.take() == [a1] and line.take() == []
    assert [(b.name, p) for b, p in line.moved()] == [("b1", 1), ("c1", 2)]
    assert line.moved() == []  # told once per change
    c1.done = True  # cancelled while it waits
    line.ended(a1)
    assert line.take() == [b1]  # b waited longer than a's next batch
    assert [(b.name, p) for b, p in line.moved()] == [("a2", 1)]
    line.ended(b1)
    assert line.take() == [a2] and line.moved() == []
    line.limit = 2
    line.ended(a2)
    assert line.take() == [a3] and line.started == 1
    line.ended(a3)
    assert line.take() == [] and line.started == 0
    with pytest.raises(ValueError, match="at least 1"):
        SessionLine(0)
