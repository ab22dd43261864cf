"""A full or read-only disk under the server's state directory (issue 10, fault 9), with a real one: a
small tmpfs filled to its last byte, or remounted read-only, under real server and device processes.

The audit is part of the command: while it cannot be written the server refuses new commands with
503 {"error": "… disk full …"} and nothing reaches the device; rows it could not write are held and
written once space is back; token and task creation answer 503 {error}; the CLI says so in one line;
a task that ends during the outage is told ended to nobody (shown as the store holds it) until its end is
saved, which it is once space is back; start-up on a full or
read-only state directory is one line and a non-zero exit.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.kits.netutil import CLI, HEARTBEAT, Proc, free_port, tether_env, wait_for, workspace_policy
from tests.kits.sse import sse_events
from tether.server.store import Store

TMPFS_SIZE = "16m"


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"this test needs a real small disk: it mounts a tmpfs ('mount {' '.join(args)}' said: "
                    f"{done.stderr.strip() or done.returncode}). Run it as root (CI does), or in a private mount "
                    "namespace as a normal user: unshare -rm .venv/bin/python -m pytest "
                    "tests/server/store/test_disk_full.py")


@pytest.fixture
def disk() -> Iterator[Path]:
    """A 16 MiB tmpfs of our own, unmounted at the end. Not under /tmp: the device's sandbox lays an
    overlay over its write roots (~ and /tmp), which a mount inside them would get in the way of."""
    path = Path(tempfile.mkdtemp(prefix="tether-disk-", dir="/var/tmp"))
    try:
        _mount("-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0700", "tmpfs", str(path))
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
        path.rmdir()


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
    assert os.statvfs(disk).f_bfree == 0
    return filler


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{text}"
    assert "Traceback" not in text
    return lines[0]


class Server:
    """A `tether server` whose database (and state directory) is on `disk`, and one device `alpha`
    whose own state is elsewhere; logs stay off the disk too."""

    def __init__(self, tmp: Path, disk: Path) -> None:
        self.tmp = tmp
        self.db = disk / "server.db"
        self.env = tether_env(disk)
        store = Store(self.db)
        _, self.token = store.tokens.create("api", "tests", ["read", "execute", "approve", "admin"])
        _, self.device_token = store.tokens.create("device", "alpha", [])
        store.close()
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}/api/v1"
        self.http = httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {self.token}"}, timeout=60)
        self.procs: list[Proc] = []
        self.server = self.start_server()
        self.device = self.start(["device", "--server", f"ws://127.0.0.1:{self.port}", "--name", "alpha",
                                  "--state-dir", str(tmp / "dev-alpha"), "--policy", str(workspace_policy(tmp))],
                                 "device",
                                 {"TETHER_DEVICE_TOKEN": self.device_token})
        self.wait_online()

    def start(self, args: list[str], label: str, env: dict[str, str] | None = None) -> Proc:
        proc = Proc(args, self.tmp / f"{label}-{len(self.procs)}.log", {**self.env, **(env or {})})
        self.procs.append(proc)
        return proc

    def start_server(self) -> Proc:
        server = self.start(["server", "--port", str(self.port), "--db", str(self.db), *HEARTBEAT,
                             "--log-level", "warning"], "server")
        wait_for(lambda: self.http.get("/health").json()["status"] == "ok", "server health", procs=(server.popen,))
        return server

    def restart_server(self) -> None:
        code = self.server.stop()
        assert code in (0, -signal.SIGTERM), f"server exited with {code}: {self.server.log.read_text()}"
        self.server = self.start_server()
        self.wait_online()

    def wait_online(self) -> None:
        def online() -> bool:
            return any(d["name"] == "alpha" and d["status"] in ("online", "busy")
                       for d in self.http.get("/devices").json())
        wait_for(online, "alpha online", 60, (self.device.popen,))

    def run(self, *commands: dict, stream: bool = False) -> httpx.Response:
        headers = {"Accept": "text/event-stream"} if stream else {}
        return self.http.post("/devices/alpha/commands", json={"commands": list(commands), "timeout": 60},
                              headers=headers)

    def audit_call_ids(self) -> dict[str, str]:
        return {row["call_id"]: row["status"] for row in self.http.get("/audit", params={"limit": 500}).json()["rows"]}

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        env = {**self.env, "TETHER_SERVER": f"http://127.0.0.1:{self.port}", "TETHER_TOKEN": self.token}
        return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=120)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.http.close()


@pytest.fixture
def server(tmp_path: Path, disk: Path) -> Iterator[Server]:
    s = Server(tmp_path, disk)
    yield s
    s.close()


def write(path: Path, call_id: str) -> dict:
    return {"tool_name": "write_file", "call_id": call_id, "parameters": {"file_path": str(path), "content": "ran"}}


def cat(fifo: Path, call_id: str, cwd: Path) -> dict:
    return {"tool_name": "shell.run", "call_id": call_id,
            "parameters": {"cmd": "cat", "argv": [str(fifo)], "cwd": str(cwd)}}


def _running(pid: int, name: str) -> bool:
    try:
        return any(p.name() == name for p in psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return False


class Blocked:
    """A `cat FIFO` running on the device until `release()`: a command in flight while the disk fills.
    The FIFO lies outside the device's write roots, where its sandbox shows the real one (inside, its
    overlay would show a pipe of its own)."""

    def __init__(self, server: Server, name: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tether-fifo-", dir="/var/tmp"))
        self.fifo = self.dir / f"{name}.fifo"
        os.mkfifo(self.fifo)
        self.server = server

    def started(self) -> None:
        wait_for(lambda: _running(self.server.device.pid, "cat"), "cat running on the device", 60,
                 (self.server.device.popen,))

    def release(self, text: str = "released\n") -> None:
        fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO, not a hang, if cat is not reading
        os.write(fd, text.encode())
        os.close(fd)

    def remove(self) -> None:
        self.fifo.unlink()
        self.dir.rmdir()


def test_full_disk_refuses_commands_holds_audit_rows_and_recovers(server: Server, disk: Path, tmp_path: Path,
                                                                  request: pytest.FixtureRequest):
    outside = tmp_path / "out"
    outside.mkdir()
    first = server.run(write(outside / "before", "before-1"))
    assert first.status_code == 200 and first.json()["results"][0]["status"] == "success", first.text
    assert server.audit_call_ids()["before-1"] == "success"

    # a command in flight when the disk fills: it ran, so its row must not be lost, only held
    blocked = Blocked(server, "inflight")
    request.addfinalizer(blocked.remove)
    answer: list[httpx.Response] = []
    caller = threading.Thread(target=lambda: answer.append(server.run(cat(blocked.fifo, "inflight-1", tmp_path))))
    caller.start()
    blocked.started()
    filler = fill(disk)
    blocked.release()
    caller.join(60)
    [done] = answer
    assert done.status_code == 200 and done.json()["results"][0]["result"]["stdout"] == "released\n", done.text
    health = wait_for(lambda: (h := server.http.get("/health").json())["audit_held"] >= 1 and h, "a held audit row")
    assert health["status"] == "degraded" and health["audit_writable"] is False
    assert server.audit_call_ids()["inflight-1"] == "sent"  # written before it ran; its outcome is held

    # new commands: 503 {error} naming the full disk, and nothing reaches the device
    for n in range(3):
        refused = server.run(write(outside / f"refused-{n}", f"refused-{n}"), stream=n == 1)
        assert refused.status_code == 503, refused.text
        assert "disk full" in refused.json()["error"] and "nothing was run" in refused.json()["error"]
    selected = server.http.post("/commands", json={"commands": [write(outside / "refused-sel", "refused-sel")]})
    assert selected.status_code == 503 and "disk full" in selected.json()["error"]
    assert not list(outside.glob("refused-*"))

    # token and task creation: 503 {error}, not a plain-text 500
    token = server.http.post("/tokens", json={"kind": "api", "name": "late"})
    assert token.status_code == 503 and "disk full" in token.json()["error"], token.text
    task = server.http.post("/tasks", json={"plan": [{"skill": "write_file", "args": {
        "file_path": str(outside / "refused-task"), "content": "x"}}], "device": "alpha"})
    assert task.status_code == 503 and "disk full" in task.json()["error"], task.text

    # the CLI: one line each, no traceback
    via_server = server.cli("exec", "--device", "alpha", "write_file", f"file_path={outside / 'refused-cli'}",
                            "content=x")
    assert via_server.returncode != 0
    assert "disk full" in one_line(via_server.stdout + via_server.stderr)
    local = server.cli("token", "create", "--api", "late", "--db", str(server.db))
    assert local.returncode != 0 and "disk full" in one_line(local.stdout + local.stderr)
    assert not list(outside.glob("refused-*"))

    # space again: the next command writes the held row first, then runs
    filler.unlink()
    after = server.run(write(outside / "after", "after-1"))
    assert after.status_code == 200 and after.json()["results"][0]["status"] == "success", after.text
    assert (outside / "after").read_text() == "ran"
    audited = server.audit_call_ids()
    assert audited["inflight-1"] == "success" and audited["after-1"] == "success"
    assert not any(cid.startswith("refused") for cid in audited)
    health = server.http.get("/health").json()
    assert health["status"] == "ok" and health["audit_held"] == 0


def test_task_ending_during_the_outage_is_consistent_and_saved_later(server: Server, disk: Path, tmp_path: Path,
                                                                     request: pytest.FixtureRequest):
    blocked = Blocked(server, "task")
    request.addfinalizer(blocked.remove)
    created = server.http.post("/tasks", json={"plan": [{"skill": "shell.run", "args": {
        "cmd": "cat", "argv": [str(blocked.fifo)], "cwd": str(tmp_path)}}], "device": "alpha"})
    assert created.status_code == 201, created.text
    task_id = created.json()["id"]
    blocked.started()
    ends: list[tuple[str, dict]] = []

    def follow() -> None:
        with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {server.token}"}) as http, \
                http.stream("GET", f"/tasks/{task_id}/events", timeout=60) as response:
            ends.extend((event, data) for event, data in sse_events(response.iter_lines()) if event == "end")

    follower = threading.Thread(target=follow)
    follower.start()
    filler = fill(disk)
    blocked.release()
    # the task ends during the outage: its end is told to nobody before it is saved, and it is shown as the store
    # holds it (running), with why its end waits
    wait_for(lambda: "not saved" in server.http.get("/health").json()["database"], "the end's save to fail", 60)
    got = server.http.get(f"/tasks/{task_id}").json()
    [listed] = [row for row in server.http.get("/tasks").json() if row["id"] == task_id]
    assert got["state"] == listed["state"] == "running" and got["ending"]["state"] == "done", got["ending"]
    assert "disk full" in got["ending"]["unsaved"]
    assert not server.http.get("/tasks", params={"state": "done"}).json()
    assert not ends and follower.is_alive()
    filler.unlink()  # space again: the save is retried, and then the end is told
    follower.join(60)
    assert not follower.is_alive(), "the follower of a task that ended during the outage hangs"
    [(_, end)] = ends
    assert end["ended"] is True and end["state"] == "done", end
    got = server.http.get(f"/tasks/{task_id}").json()
    [listed] = [row for row in server.http.get("/tasks").json() if row["id"] == task_id]
    assert got["state"] == listed["state"] == "done" and got.get("ending") is None
    assert [row["id"] for row in server.http.get("/tasks", params={"state": "done"}).json()] == [task_id]
    assert not server.http.get("/tasks", params={"state": "running"}).json()

    server.restart_server()  # the server saves what it could not, at the latest when it stops
    again = server.http.get(f"/tasks/{task_id}").json()
    assert again["state"] == "done" and again.get("pending_question") is None, again


def test_start_up_on_a_read_only_or_full_state_dir_is_one_line(disk: Path, tmp_path: Path):
    db = disk / "server.db"
    Store(db).close()
    env = tether_env(disk)

    def start() -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, "server", "--port", str(free_port()), "--db", str(db)], capture_output=True,
                              text=True, env=env, timeout=120)

    filler = fill(disk)
    full = start()
    assert full.returncode != 0 and "disk full" in one_line(full.stdout + full.stderr)
    filler.unlink()
    _mount("-o", "remount,ro", str(disk))
    read_only = start()
    assert read_only.returncode != 0 and "read-only" in one_line(read_only.stdout + read_only.stderr)
