"""A device running as root (issue 26, item 7; docs/security/root.md), tried as an attacker would.

As root, a sandbox's user namespace used to map host root: a command, capabilities dropped, still owned
every root-owned file and read `/etc/shadow`, the server's database and other devices' token files. Now
`tether device` refuses to run as root unless told, and told (`--allow-root`) it starts every sandbox as
an unprivileged user. The suite runs with TETHER_ALLOW_ROOT=1 and TETHER_RUN_AS=root (tests/conftest.py);
these tests unset both for the processes they start.

The device's sandbox must run tether's interpreter as that user: the project's own may live where no
other user can read (pyenv under /root), so the processes here run a throwaway venv made from the system
Python (tests/attacks/test_sandbox_unprivileged.py's `_python_for`), which every user can run.
"""

from __future__ import annotations

import json
import os
import pwd
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.attacks.test_sandbox_unprivileged import _check_readable, _ensure_user, _python_for

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root-only: the rules for a device running as root")

SCRIPT = r'''
import asyncio, json, os, sys
from pathlib import Path

work, state, other_token, db, private = (Path(p) for p in sys.argv[1:6])
from tether.device.config import parse_device_config
from tether.device.local import build_device
from tether.protocol.models import Command
from tether.tools.policy.model import policy_from_mapping

report = {}

async def main():
    policy = policy_from_mapping({"read_roots": [str(work), "/etc", str(other_token.parent), str(db.parent)],
                                  "write_roots": [str(work), str(private)], "commands": {"install": {}}})
    device = build_device(parse_device_config({}), policy=policy, state_dir=state, serving=True)
    sandbox = device.context.sandbox
    report["sandbox"] = None if sandbox is None else sandbox.kind
    report["run_as"] = None if sandbox is None or sandbox.spec.run_as is None else sandbox.spec.run_as.uid
    try:
        await device.computer_manager.get_or_create(None)
        d = device.dispatcher(session_id="root")

        async def run(cmd, *argv):
            [r] = await d.execute_commands([Command(tool_name="shell.run",
                                                    parameters={"cmd": cmd, "argv": list(argv), "cwd": str(work)})])
            return {"status": r.status.value, "error": r.error, "result": r.result}

        report["id"] = await run("id", "-u")
        report["shadow"] = await run("cat", "/etc/shadow")
        report["token"] = await run("cat", str(other_token))
        report["db"] = await run("cat", str(db))
        # a new file, set-uid: created files need no approval, so it is applied as the command ends
        report["create"] = await run("install", "-m", "4755", "/bin/true", str(work / "planted"))
    finally:
        await device.aclose()

asyncio.run(main())
print("REPORT " + json.dumps(report))
'''


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment without the suite's root leave (tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TETHER_ALLOW_ROOT", "TETHER_RUN_AS")}
    return {**env, "LANG": "C.UTF-8", **extra}


@pytest.fixture(scope="module")
def python() -> Iterator[str]:
    """An interpreter that imports tether and that any user (the sandbox's run_as user) can run."""
    if shutil.which("bwrap") is None:
        pytest.fail("bwrap is not installed; install it with: apt-get install -y bubblewrap")
    where = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-root-py-"))
    where.chmod(0o755)
    user = _ensure_user()
    _check_readable(user.pw_name)
    try:
        yield _python_for("nobody", where)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_root_device_without_leave_is_refused_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tether.cli", "device", "--server",
                           f"ws://127.0.0.1:{_closed_port()}", "--state-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=_clean_env(COLUMNS="60"), check=False)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: tether device refuses to run as root"), done.stderr
    assert "--allow-root" in lines[0] and "Traceback" not in done.stderr


def _stderr_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> str:
    """What the device wrote to stderr up to the line holding `marker` (waiting on the pipe, not a clock)."""
    assert proc.stderr is not None
    seen = ""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while marker not in seen:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            line = proc.stderr.readline()
            if not line:
                break
            seen += line
    return seen


def test_allow_root_starts_a_device_whose_sandbox_runs_unprivileged(python: str, tmp_path: Path) -> None:
    proc = subprocess.Popen([python, "-m", "tether.cli", "device", "--allow-root", "--server",
                             f"ws://127.0.0.1:{_closed_port()}", "--state-dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=_clean_env(TETHER_RUN_AS="nobody", COLUMNS="300",
                                           TETHER_DEVICE_TOKEN="tether-test-token"))
    try:
        seen = _stderr_until(proc, "connecting to", 90)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "warning: running as root: sandboxed commands run as user nobody" in seen, seen
    assert "sandbox: bwrap" in seen, seen
    nobody = pwd.getpwnam("nobody")  # the probe ran as that user, and its remembered answer says so
    cached = json.loads((tmp_path / "sandbox-probe.json").read_text())
    assert cached["key"]["run_as"] == [nobody.pw_uid, nobody.pw_gid] and cached["key"]["uid"] == 0, cached


def test_commands_of_a_root_device_cannot_read_root_only_files(python: str) -> None:
    base = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-root-"))
    try:
        base.chmod(0o755)
        run_as = pwd.getpwnam("nobody")
        work = base / "work"  # a write root the run_as user owns
        work.mkdir()
        os.chown(work, run_as.pw_uid, run_as.pw_gid)
        other = base / "other-device"  # another device's state: its token file, 0600 root
        other.mkdir(mode=0o755)
        token = other / "device-token"
        token.write_text("tether-other-device-token-secret\n")
        token.chmod(0o600)
        server = base / "server"
        server.mkdir(mode=0o755)
        db = server / "server.db"
        db.write_bytes(b"SQLite format 3\x00 the server's tokens")
        db.chmod(0o600)
        script = base / "device.py"
        script.write_text(SCRIPT)
        private = base / "root-only" / "project"  # a write root the run_as user cannot reach: left out
        private.mkdir(parents=True)
        private.parent.chmod(0o700)
        done = subprocess.run([python, str(script), str(work), str(base / "state"), str(token), str(db),
                               str(private)],
                              capture_output=True, text=True, timeout=180, check=False,
                              env=_clean_env(TETHER_RUN_AS="nobody"), cwd=base)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")), None)
        assert line, f"the device script failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
        report = json.loads(line.removeprefix("REPORT "))
        assert report["sandbox"] and report["sandbox"].startswith("bwrap"), done.stderr
        assert report["run_as"] == run_as.pw_uid
        assert f"write roots {private} are out of reach of the sandbox's user nobody" in done.stderr, done.stderr
        assert report["id"]["status"] == "success", report["id"]
        assert report["id"]["result"]["stdout"].strip() == str(run_as.pw_uid), report["id"]
        for what in ("shadow", "token", "db"):
            r = report[what]
            assert r["status"] == "failure" and "Permission denied" in json.dumps(r), (what, r)
            assert "secret" not in json.dumps(r) and "tokens" not in json.dumps(r), (what, r)
        # still writes where it may; what it planted lands with the directory's owner and no set-uid bit
        assert report["create"]["status"] == "success", report["create"]
        planted = os.lstat(work / "planted")
        assert (planted.st_uid, planted.st_gid) == (run_as.pw_uid, run_as.pw_gid)
        assert planted.st_mode & 0o7000 == 0, oct(planted.st_mode)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_an_unprivileged_user_needs_no_leave(python: str) -> None:
    user = _ensure_user()
    state = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-root-user-"))
    try:
        os.chown(state, user.pw_uid, user.pw_gid)
        env = {"HOME": user.pw_dir, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "COLUMNS": "300",
               "TETHER_DEVICE_TOKEN": "tether-test-token"}
        proc = subprocess.Popen(["runuser", "-u", user.pw_name, "--", "env", "-i",
                                 *[f"{k}={v}" for k, v in env.items()], python, "-m", "tether.cli", "device",
                                 "--server", f"ws://127.0.0.1:{_closed_port()}", "--state-dir", str(state)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd="/")
        try:
            seen = _stderr_until(proc, "connecting to", 90)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        assert "connecting to" in seen and "root" not in seen, seen
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_a_live_process_of_a_root_device_runs_unprivileged(python: str, tmp_path: Path) -> None:
    """A sandboxed stdio MCP server (tether.sandbox.confine.bwrap.live_argv) starts as the run_as user too.

    Its argv is built by an interpreter the run_as user can run (the `python` fixture), as a device
    installed where that user reaches would: the seccomp shim in front of a live process is that
    interpreter (`confine_argv`), run inside the sandbox as the run_as user."""
    code = ("import json, sys\n"
            "from tether.sandbox.confine.bwrap import live_argv\n"
            "from tether.sandbox.confine.run_as import resolve_run_as\n"
            "from tether.sandbox.confine.spec import SandboxSpec\n"
            "run_as = resolve_run_as('nobody')\n"
            "spec = SandboxSpec.build(write_roots=[], hidden=['/root', sys.argv[1]], layers_dir=sys.argv[1],"
            " run_as=run_as)\n"
            "print(json.dumps([run_as.uid, run_as.gid, live_argv(spec, ['sh', '-c', 'id -u; id -G; cat /etc/shadow'],"
            " cwd='/')]))\n")
    built = subprocess.run([python, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                           check=False)
    assert built.returncode == 0, built
    uid, gid, argv = json.loads(built.stdout)
    assert argv[0].endswith("setpriv") and f"--reuid={uid}" in argv, argv
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.split() == [str(uid), str(gid)], done
    assert "Permission denied" in done.stderr and done.returncode != 0, done


def test_leave_to_run_as_root_comes_from_the_flag_the_environment_or_the_config() -> None:
    from tether.device.config import parse_device_config
    from tether.device.root import RootRefused, root_check

    plain, allowed = parse_device_config({}), parse_device_config({"device": {"allow_root": True}})
    with pytest.raises(RootRefused, match="--allow-root"):
        root_check(plain, False, "tether device", env={})
    assert "run as user nobody" in root_check(plain, True, "tether device", env={"TETHER_RUN_AS": "nobody"})
    env = {"TETHER_ALLOW_ROOT": "1", "TETHER_RUN_AS": "nobody"}
    assert "run as user nobody" in root_check(plain, False, "x", env=env)
    assert "run as user nobody" in root_check(allowed, False, "x", env={"TETHER_RUN_AS": "nobody"})
    config_user = parse_device_config({"device": {"allow_root": True, "run_as": "nobody"}})
    assert "run as user nobody" in root_check(config_user, False, "x", env={})
    as_root = root_check(allowed, False, "x", env={"TETHER_RUN_AS": "root"})
    assert "run as root and can read every root-only file" in as_root
    with pytest.raises(ValueError, match="no user 'tether-no-such-user'"):
        root_check(allowed, False, "x", env={"TETHER_RUN_AS": "tether-no-such-user"})


def test_local_exec_and_run_as_root_are_refused_in_one_line(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("- skill: shell.run\n  args: {cmd: id}\n")
    for args in (["exec", "shell.run", "cmd=id"], ["run", "--plan", str(plan)]):
        done = subprocess.run([sys.executable, "-m", "tether.cli", *args], capture_output=True, text=True, timeout=60,
                              env=_clean_env(COLUMNS="60", TETHER_STATE_DIR=str(tmp_path / "state")), check=False)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (args, done)
        assert lines[0].startswith(f"error: tether {args[0]} refuses to run as root"), (args, done.stderr)
