"""What every chaos scenario shares: a server that can be killed and started again on the same port and
database, devices (optionally behind a `FaultProxy`), commands whose runs are counted, and the one
invariant check every scenario ends with.

Counted commands (`Runs`): a small Python script run through `shell.run` that appends its label to
`runs.log` in a *live* write root (the sandbox captures writes to normal write roots until a command
ends; live roots are bound as they are, so the test sees a run the moment it happens), then writes
its label into the `started` FIFO the test reads (an event, not a poll), then, when gated, blocks
reading its own gate FIFO until the test opens it, and prints `out:<label>`. A result's stdout thus
names the command that produced it, and `runs.log` says how often each one ran.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.kits import db as dbkit
from tests.kits.netutil import Proc, free_port, tether_env, wait_for, workspace_roots
from tether.client.rest import RemoteError, RemoteServer
from tether.protocol.models import Command, Result, ResultStatus
from tether.server.store.audit import LATE_NOTE

# heartbeats every 0.3 s, a link silent for 2 s is dead, a dropped device's batches wait 3 s for it
SERVER_TIMING = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "2", "--grace-period", "3"]
TERMINAL = {"done", "failed", "cancelled"}
WAIT = 30.0

SCRIPT = """\
import os, select, sys
label, gated = sys.argv[1], sys.argv[2] == "gated"
if gated:  # open before announcing the start, so the test's open_gate always finds a reader
    gate = os.open(os.path.join({gates!r}, label), os.O_RDONLY | os.O_NONBLOCK)
with open({log!r}, "a") as f:
    f.write(label + "\\n")
fd = os.open({started!r}, os.O_WRONLY)
os.write(fd, (label + "\\n").encode())
os.close(fd)
if gated:
    while True:  # wait for the test's bytes (a FIFO no writer has opened yet is not readable)
        select.select([gate], [], [])
        try:
            if os.read(gate, 64):
                break
        except BlockingIOError:
            pass
print("out:" + label)
"""


class Runs:
    """Counted, optionally gated commands; see the module's docstring."""

    def __init__(self, tmp: Path) -> None:
        self.live = tmp / "live"
        self.gates = self.live / "gates"
        self.gates.mkdir(parents=True)
        self.log = self.live / "runs.log"
        self.log.touch()
        self.started_fifo = self.live / "started"
        os.mkfifo(self.started_fifo)
        # our own read end and a spare write end: reads block until a script writes, never see EOF
        self._read_fd = os.open(self.started_fifo, os.O_RDONLY | os.O_NONBLOCK)
        self._spare_fd = os.open(self.started_fifo, os.O_WRONLY | os.O_NONBLOCK)
        self._buffer = b""
        self.seen_started: list[str] = []
        self.script = tmp / "counted.py"
        self.script.write_text(SCRIPT.format(log=str(self.log), started=str(self.started_fifo),
                                             gates=str(self.gates)))
        self.policy = tmp / "chaos-policy.yaml"
        self.policy.write_text(workspace_roots(tmp) + f"live_write_roots: [{str(self.live)!r}]\n")
        self.commands: dict[str, Command] = {}  # label -> the command

    def close(self) -> None:
        for fd in (self._read_fd, self._spare_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def command(self, label: str, *, gated: bool = False) -> Command:
        if gated:
            os.mkfifo(self.gates / label)
        cmd = Command(tool_name="shell.run", call_id=f"call-{label}",
                      parameters={"cmd": "python3", "argv": [str(self.script), label, "gated" if gated else "free"],
                                  "cwd": str(self.script.parent)})
        self.commands[label] = cmd
        return cmd

    def step(self, label: str, *, gated: bool = False) -> dict[str, Any]:
        """The same counted command as a task's plan step."""
        if gated:
            os.mkfifo(self.gates / label)
        return {"skill": "shell.run", "args": {"cmd": "python3", "argv": [str(self.script), label,
                                                                          "gated" if gated else "free"],
                                               "cwd": str(self.script.parent)}}

    def wait_started(self, label: str, timeout: float = WAIT) -> None:
        """Block until the script labelled `label` has announced itself on the `started` FIFO."""
        end = time.monotonic() + timeout
        while label not in self.seen_started:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"command {label!r} did not start within {timeout:g}s "
                                     f"(started: {self.seen_started}, runs: {self.counts()})")
            readable, _, _ = select.select([self._read_fd], [], [], left)
            if readable:
                with contextlib.suppress(BlockingIOError):
                    self._buffer += os.read(self._read_fd, 4096)
                *lines, self._buffer = self._buffer.split(b"\n")
                self.seen_started += [line.decode() for line in lines]

    def open_gate(self, label: str) -> bool:
        """Let a gated command finish; False when nothing waits at its gate (it is not running)."""
        try:
            fd = os.open(self.gates / label, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no reader: the command is not (or no longer) running
                return False
            raise
        try:
            os.write(fd, b"go")
        except BrokenPipeError:  # the reader went between the open and the write (its device was killed)
            return False
        finally:
            os.close(fd)
        return True

    def counts(self) -> Counter[str]:
        return Counter(line for line in self.log.read_text().splitlines() if line)


@dataclass
class Sent:
    """A command a caller sent and what that caller got back (None: no result at all)."""

    label: str
    command: Command
    result: Result | None = None
    caller_error: str | None = None  # a clear failure of the call itself (e.g. the server died)


@dataclass
class Ledger:
    sent: list[Sent] = field(default_factory=list)
    retried: set[str] = field(default_factory=set)  # labels a person asked to run again (a task's "retry")

    def record(self, commands: list[Command], labels: list[str], results: list[Result] | None,
               error: str | None = None) -> None:
        by_call = {r.call_id: r for r in results or []}
        for label, cmd in zip(labels, commands, strict=True):
            self.sent.append(Sent(label, cmd, by_call.get(cmd.call_id), error))


@dbkit.keeps_server_state
class ChaosCluster:
    """A `tether server` process (killable, restartable on the same port and database) and devices.

    `state` is the server's state directory (a small tmpfs for the full-disk scenario); the devices'
    state and every log stay in `tmp`."""

    def __init__(self, tmp: Path, state: Path | None = None, names: tuple[str, ...] = ("alpha", "beta")) -> None:
        self.tmp = tmp
        self.state = state or tmp / "state"
        self.state.mkdir(exist_ok=True)
        self.db = self.state / "server.db"
        self.env = tether_env(self.state)
        self.api_token, self.other_token, *devices = dbkit.create_tokens(dbkit.server_db(self.db), [
            ("api", "chaos", ["read", "execute", "approve", "admin"]), ("api", "other", ["read", "execute"]),
            *(("device", name, []) for name in names)])
        self.device_tokens = dict(zip(names, devices, strict=True))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[Proc] = []
        self.devices: dict[str, Proc] = {}
        self.remote = RemoteServer(self.url, self.api_token)
        self.server = self.start_server()

    # -- processes -------------------------------------------------------------------------------

    def _start(self, args: list[str], label: str, env: dict[str, str] | None = None) -> Proc:
        proc = Proc(args, self.tmp / f"{label}-{len(self.procs)}.log", {**self.env, **(env or {})})
        self.procs.append(proc)
        return proc

    def start_server(self) -> Proc:
        server = self._start(["server", "--port", str(self.port), *dbkit.server_db_args(self.db), *SERVER_TIMING,
                              "--log-level", "warning"], "server")
        wait_for(lambda: self.remote.health()["status"] in ("ok", "degraded"), "server health", WAIT,
                 (server.popen,))
        return server

    def kill_server(self) -> None:
        """kill -9: no shutdown handler runs, nothing is flushed."""
        self.server.kill()

    def restart_server(self) -> None:
        self.server = self.start_server()

    def device(self, name: str, runs: Runs, port: int | None = None) -> Proc:
        args = ["device", "--server", f"ws://127.0.0.1:{port or self.port}", "--name", name,
                "--state-dir", str(self.tmp / f"dev-{name}"), "--policy", str(runs.policy)]
        proc = self._start(args, f"device-{name}", {"TETHER_DEVICE_TOKEN": self.device_tokens[name]})
        self.devices[name] = proc
        self.wait_online(name)
        return proc

    def status(self, name: str) -> str | None:
        return next((row["status"] for row in self.remote.devices() if row["name"] == name), None)

    def wait_online(self, name: str, timeout: float = WAIT) -> None:
        wait_for(lambda: self.status(name) in ("online", "busy"), f"{name} online", timeout,
                 (self.devices[name].popen, self.server.popen))

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.remote.close()

    # -- callers ---------------------------------------------------------------------------------

    def client(self, token: str | None = None) -> RemoteServer:
        return RemoteServer(self.url, token or self.api_token)

    def run(self, device: str, commands: list[Command], labels: list[str], ledger: Ledger, *,
            token: str | None = None, timeout: float = WAIT) -> list[Result] | None:
        """Run a batch as a caller would, record what came back (or the clear error) in `ledger`."""
        with self.client(token) as remote:
            try:
                _, results = remote.run(device, commands, timeout=timeout)
            except RemoteError as exc:
                ledger.record(commands, labels, None, str(exc))
                return None
        ledger.record(commands, labels, results)
        return results

    def audit(self) -> list[dict[str, Any]]:
        return self.remote._request("GET", "/audit", params={"limit": 500})["rows"]

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url + "/api/v1", headers={"Authorization": f"Bearer {self.api_token}"},
                            timeout=WAIT)


def check_invariants(cluster: ChaosCluster, runs: Runs, ledger: Ledger, *, unknown_ok: frozenset[str] = frozenset()
                     ) -> None:
    """After a scenario: no command ran twice, every delivered success ran exactly once and carries its
    own output (never another caller's), every call got a result or a clear error, every task is in a
    terminal or waiting state that GET /tasks and GET /tasks/{id} agree on, and the audit has a row
    for every command that was sent (REST batches and task steps alike)."""
    counts = runs.counts()
    problems: list[str] = []
    twice = {label: n for label, n in counts.items() if n > 1 and label not in runs_retried(ledger)}
    if twice:
        problems.append(f"commands run more than once: {twice}")
    labels = set(runs.commands) | set(counts)
    audited = {row["call_id"]: row for row in cluster.audit()}

    for sent in ledger.sent:
        result = sent.result
        if result is None:
            if not sent.caller_error:
                problems.append(f"{sent.label}: no result and no error (a silent loss)")
            continue
        if result.call_id != sent.command.call_id:
            problems.append(f"{sent.label}: got the result of call {result.call_id}")
        text = result.model_dump_json()
        strangers = [other for other in labels
                     if other != sent.label and re.search(rf"out:{re.escape(other)}(?![\w-])", text)]
        if strangers:
            problems.append(f"{sent.label}: its result carries the output of {strangers}")
        if result.status is ResultStatus.SUCCESS:
            stdout = (result.result or {}).get("stdout") if isinstance(result.result, dict) else None
            if stdout != f"out:{sent.label}\n":
                problems.append(f"{sent.label}: success with stdout {stdout!r}")
            if counts[sent.label] != 1:
                problems.append(f"{sent.label}: delivered as a success but ran {counts[sent.label]} time(s)")
        elif not result.error:
            problems.append(f"{sent.label}: {result.status.value} without an error saying why")
        row = audited.get(sent.command.call_id)
        if row is None:
            problems.append(f"{sent.label}: no audit row for call {sent.command.call_id} ({result.status.value})")
        elif result.outcome_pending:  # the audit agrees while it is open, and once the outcome came, late
            if row["status"] not in ("pending", "unknown") and not (row["error"] or "").startswith(LATE_NOTE):
                problems.append(f"{sent.label}: delivered as outcome pending, audited as {row['status']} "
                                f"({row['error']})")
        elif row["status"] != result.status.value and not (row["status"] == "unknown" and sent.label in unknown_ok):
            problems.append(f"{sent.label}: audited as {row['status']}, delivered as {result.status.value}")

    for sent in ledger.sent:  # a call that failed as a whole (the server died under it) still ran, or not
        if sent.result is None and counts[sent.label] and sent.command.call_id not in audited:
            problems.append(f"{sent.label}: ran on the device ({counts[sent.label]}x) but has no audit row "
                            f"(call {sent.command.call_id})")

    listed = {row["id"]: row for row in cluster.remote.tasks(limit=500)}
    for task_id, row in listed.items():
        task = cluster.remote.task(task_id)
        if task["state"] != row["state"]:
            problems.append(f"task {task_id}: GET /tasks says {row['state']}, GET /tasks/{{id}} {task['state']}")
        if row["state"] not in TERMINAL | {"waiting_for_user"}:
            problems.append(f"task {task_id}: left {row['state']}")
        if row["state"] == "waiting_for_user" and not row.get("question"):
            problems.append(f"task {task_id}: waiting for a person, with no question")
        for step in task.get("steps", []):
            call_id = (step.get("command") or {}).get("call_id")
            if call_id and call_id not in audited:
                problems.append(f"task {task_id}: step {step.get('index')} (call {call_id}) has no audit row")
        for event in task.get("events", []):
            if event["kind"] == "step_started" and (call_id := event["data"].get("call_id")) \
                    and call_id not in audited:
                problems.append(f"task {task_id}: started step {event['data'].get('step')} (call {call_id}) "
                                "has no audit row")
    assert not problems, "chaos invariants broken:\n  " + "\n  ".join(dict.fromkeys(problems))


def runs_retried(ledger: Ledger) -> set[str]:
    return ledger.retried


def child_gone(pid: int) -> bool:
    """True once `pid` has exited (a process we did not start: pidfd + poll, no sleeping)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], WAIT)[0])
    finally:
        os.close(fd)


def mount_tmpfs(path: Path, size: str) -> None:
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(
            f"the full-disk scenario needs a real small disk: 'mount -t tmpfs' said {done.stderr.strip()!r}. "
            "Run it as root (CI does), or in a private mount namespace: "
            "unshare -rm .venv/bin/python -m pytest tests/chaos")


def fill(disk: Path) -> Path:
    """Write a file until the disk refuses the last byte (ENOSPC); deleting it frees the space."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            chunk = b"\0" * size
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)
    return filler


def pids_running(script: Path, label: str) -> list[int]:
    """Processes running the counted script for `label` (e.g. one a killed device left behind)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if str(script) in cmdline and label in cmdline:
            found.append(proc.pid)
    return found
