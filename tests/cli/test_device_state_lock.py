"""One device process per state directory (issue 28, "one state per device process"): two `tether device`
processes under one $HOME used to share one state directory — one undo journal, one key, one token — so
`tether undo` listed each restore under both devices. A device now takes an exclusive lock on its state
directory before touching anything in it: a second one is refused in one line that names the first one's pid
and how to run two, and changes nothing. Real server and device processes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kits.netutil import Cluster, Proc, wait_for

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
    assert "device.lock" in before and (state / "device.lock").read_text().split() == [str(first.pid)]

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
    assert (state / "device.lock").read_text().split() == [str(again.pid)]
    assert os.stat(state).st_mode & 0o077 == 0
