"""The sessions' private /tmp bases (`<tmp>/.tether-tmp-<uid>-…`) do not pile up on a machine: a device that stops
cleanly removes its base when no session is left in it, and a device's start clears away the bases that no
living device holds (one killed, one whose state directory was thrown away) — but never a living device's base,
never a session that may come back, never anything another user made or a link leads to.

Real `tether device` processes on a real server, a real `tether exec`, real bubblewrap sandboxes, all with one
temp dir of the test's own (TMPDIR), in which an attacker has planted look-alikes first.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kits.netutil import Cluster, Proc, wait_for
from tether.protocol.models import Command, ResultStatus
from tether.sandbox.private_tmp import session_key

OLD = time.time() - 3 * 24 * 3600  # idle well past the 24 h a session's /tmp outlives its last use
STRANGER = 65534  # nobody


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()


def bases(temp: Path) -> set[str]:
    return {p.name for p in temp.iterdir() if p.name.startswith(".tether-tmp-")}


def base_dir(temp: Path, name: str, *, mode: int = 0o700, sessions: dict[str, float] | None = None) -> Path:
    """A directory shaped like a base, with session directories last used at the given times."""
    path = temp / name
    path.mkdir(mode=mode)
    path.chmod(mode)
    for session, used in (sessions or {}).items():
        (path / session).mkdir(mode=0o700)
        (path / session / "left.txt").write_text("what a command left\n")
        os.utime(path / session, (used, used))
    return path


def test_bases_are_removed_when_empty_and_unheld_and_never_otherwise(cluster: Cluster, tmp_path: Path) -> None:
    temp = tmp_path / "temp"
    temp.mkdir(mode=0o1777)
    temp.chmod(0o1777)  # a machine's /tmp: sticky, everyone's
    home = tmp_path / "home"
    home.mkdir()
    uid = os.getuid()
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"write_roots": ["~", str(temp)], "private_tmp": True}))
    env = {"TMPDIR": str(temp), "HOME": str(home)}

    # left by devices that are gone: an empty base, one whose only session is long idle (both go), and one
    # whose session was used an hour ago, by a device that stopped and may come back (it stays)
    base_dir(temp, f".tether-tmp-{uid}-gone")
    base_dir(temp, f".tether-tmp-{uid}-idle", sessions={session_key("old"): OLD})
    base_dir(temp, f".tether-tmp-{uid}-recent", sessions={session_key("recent"): time.time() - 3600})
    # planted: a base-shaped directory of another user, one that others may enter, and a link to a
    # directory of the device's user (empty but for a long-idle session, so that following it would empty it)
    planted = {f".tether-tmp-{uid}-wide"}
    base_dir(temp, f".tether-tmp-{uid}-wide", mode=0o755)
    if uid == 0:
        stranger = base_dir(temp, f".tether-tmp-{uid}-stranger", sessions={session_key("x"): OLD})
        for path in (stranger, *stranger.rglob("*")):
            os.chown(path, STRANGER, STRANGER, follow_symlinks=False)
        planted.add(stranger.name)
    victim = base_dir(tmp_path, "victim", sessions={session_key("v"): OLD})
    (temp / f".tether-tmp-{uid}-link").symlink_to(victim)
    planted.add(f".tether-tmp-{uid}-link")

    # one layers directory for every device and exec of the user: each records its base in its own state directory
    (tmp_path / "layers").mkdir(mode=0o700)
    env["TETHER_SANDBOX_LAYERS"] = str(tmp_path / "layers")

    def device(name: str) -> Proc:
        proc = cluster.device(name, extra=("--policy", str(policy)), env=env)
        cluster.wait_online(name, proc)
        return proc

    def run(name: str, session: str, *commands: Command) -> None:
        _, results = cluster.remote.run(name, list(commands), session_id=session)
        assert all(r.status is ResultStatus.SUCCESS for r in results), results

    echo = Command(tool_name="shell.run", parameters={"cmd": "echo", "argv": ["hi"], "cwd": str(home)})
    end = Command(tool_name="end_session")

    # device A's first command starts its sandbox: the bases nobody holds are cleared away, the others stay
    alpha = device("alpha")
    run("alpha", "a1", echo)
    [own_a] = bases(temp) - planted - {f".tether-tmp-{uid}-recent"}
    assert bases(temp) == {own_a, f".tether-tmp-{uid}-recent", *planted}
    assert (temp / own_a / session_key("a1")).is_dir()
    assert (victim / session_key("v") / "left.txt").exists()  # nothing followed through the link
    run("alpha", "a1", end)  # its base is empty now, but A lives: it holds it

    # device B ends its session too, then is killed: its empty base is left behind, held by nobody
    beta = device("beta")
    run("beta", "b1", echo, end)
    [own_b] = bases(temp) - {own_a, f".tether-tmp-{uid}-recent", *planted}
    beta.kill()
    wait_for(lambda: cluster.status("beta") == "offline", "beta offline", 60)
    assert own_b in bases(temp)

    # a one-off `tether exec` (a device of its own state directory) starts: B's base goes, A's stays; and its
    # own goes when it stops, its one session over
    exec_env = {**cluster.env, **env, "TETHER_STATE_DIR": str(tmp_path / "exec-state")}
    ran = cluster.start(["exec", "--policy", str(policy), "shell.run", "cmd=echo", "argv:=[\"x\"]", f"cwd={home}"],
                        "exec", exec_env)
    assert ran.popen.wait(timeout=120) == 0, ran.output()
    assert bases(temp) == {own_a, f".tether-tmp-{uid}-recent", *planted}

    # the attacker takes the swept base's name, which B's record still names: B comes back and never uses it
    if uid == 0:
        squat = base_dir(temp, own_b)
        os.chown(squat, STRANGER, STRANGER)
    else:
        (temp / own_b).symlink_to(victim)
    planted.add(own_b)
    beta = device("beta")
    run("beta", "b2", echo)
    [own_b2] = bases(temp) - {own_a, f".tether-tmp-{uid}-recent", *planted}
    assert (temp / own_b2 / session_key("b2")).is_dir() and not (temp / own_b / session_key("b2")).exists()
    assert not (victim / session_key("b2")).exists()
    assert beta.stop() == 0 and own_b2 in bases(temp)  # a session left in it: it stays for that session
    beta = device("beta")
    run("beta", "b2", end)  # found again through the record; its last session ends
    assert beta.stop() == 0 and own_b2 not in bases(temp) and own_b in bases(temp)

    # A stops cleanly: its empty base goes with it (and its record: a restart makes a new one)
    assert alpha.stop() == 0
    assert bases(temp) == {f".tether-tmp-{uid}-recent", *planted}
    assert not (cluster.state / "dev-alpha" / "private-tmp-base").exists()
    assert not list((tmp_path / "layers").glob("*private-tmp-base*"))
    assert (victim / session_key("v") / "left.txt").exists()
    assert (temp / f".tether-tmp-{uid}-recent" / session_key("recent") / "left.txt").exists()
    if uid == 0:
        assert (temp / f".tether-tmp-{uid}-stranger" / session_key("x") / "left.txt").exists()
