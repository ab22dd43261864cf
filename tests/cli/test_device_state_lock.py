"""One device process per state directory (issue 28, "one state per device process"): two `tether device`
processes under one $HOME used to share one state directory — one undo journal, one key, one token — so
`tether undo` listed each restore under both devices. A device now takes an exclusive lock on its state
directory before touching anything in it: a second one is refused in one line that names the first one's pid
and how to run two, and changes nothing. Real server and device processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kits.netutil import CLI, Cluster, Proc, wait_for
from tests.kits.state_holder import holder

USAGE_EXIT = 2


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()


def device_at_home(cluster: Cluster, name: str, home: Path, label: str) -> Proc:
    """`tether device` with only $HOME to say where its state is (no --state-dir, no TETHER_STATE_DIR)."""
    env = {k: v for k, v in cluster.env.items() if k not in ("TETHER_STATE_DIR", "XDG_STATE_HOME")}
    proc = Proc(["device", "--server", f"ws://127.0.0.1:{cluster.port}", "--name", name], cluster.tmp / f"{label}.log",
                {**env, "HOME": str(home), "TETHER_DEVICE_TOKEN": cluster.device_tokens[name]})
    cluster.procs.append(proc)
    return proc


def files(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_second_device_on_one_state_directory_is_refused_and_changes_nothing(cluster: Cluster,
                                                                               tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    state = home / ".local" / "state" / "tether"
    first = device_at_home(cluster, "alpha", home, "first")
    cluster.wait_online("alpha", first)
    before = files(state)
    assert "device.lock" in before and (state / "device.lock").read_text().split()[0] == str(first.pid)

    second = device_at_home(cluster, "beta", home, "second")
    assert second.popen.wait(timeout=60) == USAGE_EXIT, second.output()
    lines = second.output().strip().splitlines()
    assert len(lines) == 1, lines
    assert f"another tether device (pid {first.pid}) already uses the state directory {state}" in lines[0]
    assert "--state-dir" in lines[0] and "TETHER_STATE_DIR" in lines[0]
    assert files(state) == before  # nothing read into or written by the second one
    assert cluster.status("beta") is None  # it never reached the server
    assert cluster.status("alpha") in ("online", "busy") and first.popen.poll() is None

    # a state directory of its own: both run
    own = cluster.start(["device", "--server", f"ws://127.0.0.1:{cluster.port}", "--name", "beta",
                         "--state-dir", str(tmp_path / "beta-state")], "own", {
                             "TETHER_DEVICE_TOKEN": cluster.device_tokens["beta"]})
    cluster.wait_online("beta", own)

    # the lock goes with its process, however it ends: no stale lock after kill -9
    first.kill()
    wait_for(lambda: cluster.status("alpha") == "offline", "alpha offline", 60)
    again = device_at_home(cluster, "alpha", home, "again")
    cluster.wait_online("alpha", again)
    assert (state / "device.lock").read_text().split() == [str(again.pid), "tether", "device"]
    assert os.stat(state).st_mode & 0o077 == 0


def refused(cluster: Cluster, args: list[str], label: str, holder: str, pid: int, state: Path) -> None:
    """`tether ARGS` is refused at once, in one line naming the holder of `state`, having written nothing there."""
    before = files(state)
    proc = cluster.start(args, label, {"TETHER_DEVICE_TOKEN": cluster.device_tokens["beta"]})
    assert proc.popen.wait(timeout=60) == USAGE_EXIT, proc.output()
    *warnings, line = proc.output().strip().splitlines()
    assert all(w.startswith("warning: running as root") for w in warnings), warnings  # as root: said first
    assert line.startswith(f"error: another {holder} (pid {pid}) already uses the state directory {state} ("), line
    assert files(state) == before  # no task store, journal or probe of its own there


def test_every_local_entry_point_holds_the_state_directory(cluster: Cluster, tmp_path: Path) -> None:
    """`tether run` and `tether exec` on this machine, `tether mcp serve` and `tether device` take one lock: a
    running device's state directory (its undo journal, private /tmp, sessions' totals) is never shared with a
    local task, and the other way round; the lock names who holds it."""
    state = tmp_path / "shared-state"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"skill": "get_system_info", "args": {}}]))
    device = cluster.device("alpha", state_dir=state)
    cluster.wait_online("alpha", device)
    local = ["--state-dir", str(state)]
    refused(cluster, ["run", "--local", "--plan", str(plan), *local], "run", "tether device", device.pid, state)
    refused(cluster, ["exec", "get_system_info", *local], "exec", "tether device", device.pid, state)
    assert device.stop() == 0 and "device stopped" in device.log.read_text()

    # an MCP client's `tether mcp serve` holds it while it serves: the device is refused now
    serve = subprocess.Popen([*CLI, "mcp", "serve", "--stdio", *local], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=cluster.env)
    try:
        wait_for(lambda: (state / "device.lock").read_text().split() == [str(serve.pid), "tether", "mcp", "serve"],
                 "mcp serve holds the state directory", 60, (serve,))
        refused(cluster, ["device", "--server", f"ws://127.0.0.1:{cluster.port}", "--name", "beta", *local],
                "device", "tether mcp serve", serve.pid, state)
        refused(cluster, ["run", "--local", "--plan", str(plan), *local], "run2", "tether mcp serve", serve.pid, state)
    finally:
        assert serve.stdin is not None
        serve.stdin.close()  # its client went away: it ends, and its lock with it
        serve.wait(timeout=60)
    ran = cluster.start(["exec", "get_system_info", *local], "exec-after")
    assert ran.popen.wait(timeout=60) == 0, ran.output()


def test_a_state_directory_that_cannot_exist_holds_nothing_to_share(tmp_path: Path) -> None:
    """No lock can be taken where no state directory can be made (under a file here; a read-only home): no other
    process can be using it either, so a read-only call still runs, as it did."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "OPENAI_")) or k == "TETHER_ALLOW_ROOT"}
    ran = subprocess.run([*CLI, "exec", "get_system_info", "info_type=os", "--state-dir", str(blocker / "state")],
                         capture_output=True, text=True, timeout=120, env={**env, "TETHER_ALLOW_ROOT": "1"})
    assert ran.returncode == 0 and "Traceback" not in ran.stderr, ran.stderr


def waiting_exec(state: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Thread, list[str]]:
    """A second local exec taking `state`'s lock in a thread (waiting up to 60 s): the event set at its first
    pause (it was refused once and waits), the thread, and what it read in the lock file once it held it."""
    from tether.cli.guards import state_lock

    paused = threading.Event()
    real_sleep = state_lock.time.sleep

    def sleep(seconds: float) -> None:
        paused.set()
        real_sleep(seconds)

    monkeypatch.setattr(state_lock.time, "sleep", sleep)
    got: list[str] = []

    def second() -> None:
        with state_lock.holding_state_dir(state, "tether exec", wait_s=60):
            got.append((state / "device.lock").read_text())

    waiter = threading.Thread(target=second)
    waiter.start()
    return paused, waiter, got


def test_a_local_exec_waits_for_another_one_off_call_and_refuses_a_device(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Scripts run local `tether exec` calls side by side: a second one waits for the first (within its
    --timeout) instead of failing, while a long-running holder (a device) is refused at once. The waiter's
    first pause is what releases the holder here, so the wait itself is what is tested."""
    from tether.cli.guards import state_lock

    state = tmp_path / "state"
    brief = holder(state, "tether exec")
    paused, waiter, got = waiting_exec(state, monkeypatch)
    assert paused.wait(30)  # refused once, waiting
    assert brief.stdin is not None
    brief.stdin.close()
    assert brief.wait(timeout=30) == 0
    waiter.join(timeout=30)
    assert got == [f"{os.getpid()} tether exec\n"]

    device = holder(state, "tether device")
    try:
        paused.clear()
        with pytest.raises(SystemExit) as refused, state_lock.holding_state_dir(state, "tether exec", wait_s=60):
            pass
        assert refused.value.code == USAGE_EXIT and not paused.is_set()  # refused without waiting
    finally:
        assert device.stdin is not None
        device.stdin.close()
        device.wait(timeout=30)

    stuck = holder(state, "tether exec")
    try:
        with pytest.raises(SystemExit), state_lock.holding_state_dir(state, "tether exec", wait_s=0.05):
            pass  # a one-off call still there when the bound ends: refused as before
    finally:
        assert stuck.stdin is not None
        stuck.stdin.close()
        stuck.wait(timeout=30)


def test_local_execs_side_by_side_all_answer(tmp_path: Path) -> None:
    """Three local `tether exec` processes on one state directory at once: every one answers."""
    env = {**os.environ, "TETHER_STATE_DIR": str(tmp_path / "state")}
    procs = [subprocess.Popen([*CLI, "exec", "get_system_info", "info_type=os", "--json"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert json.loads(out)["status"] == "success"


RAW_HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_lock_taken_an_instant_ago_and_not_yet_named_is_waited_for(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The race three side-by-side local execs met: one took the lock, and before it wrote its line the next
    read an empty file — an unnamed holder, refused at once as "another tether process". A lock whose holder
    has not yet written who it is now counts as one being taken (the next look names it): the waiter pauses,
    and gets it when the holder goes. The holder here never writes its line; the waiter's first pause is what
    releases it."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    raw = subprocess.Popen([CLI[0], "-c", RAW_HOLD, str(state / "device.lock")], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    assert raw.stdout is not None and raw.stdout.readline() == "held\n"
    paused, waiter, got = waiting_exec(state, monkeypatch)
    try:
        assert paused.wait(30)  # not refused: waiting for the unnamed holder
    finally:
        assert raw.stdin is not None
        raw.stdin.close()
        raw.wait(timeout=30)
    waiter.join(timeout=30)
    assert got == [f"{os.getpid()} tether exec\n"]


def test_the_holders_line_is_whole_after_a_longer_one(tmp_path: Path) -> None:
    """Each holder writes its line over the last one's and then cuts the file, so the file never reads empty
    and never keeps a tail of a longer line before it."""
    from tether.device.local import hold_state_dir

    state = tmp_path / "state"
    os.close(hold_state_dir(state, "tether tools serve"))
    fd = hold_state_dir(state, "tether exec")
    try:
        assert (state / "device.lock").read_text() == f"{os.getpid()} tether exec\n"
    finally:
        os.close(fd)
