"""The sandbox's core promises as an ordinary user, not root (CI runs as root; a desktop never does).

As root, the test creates the user `tether-sbx` (`useradd -m`) if it is missing and runs a small
device script as that user with `runuser`. The project's own interpreter may live where that user
cannot read (pyenv under /root, mode 0700), so the script runs from a throwaway venv made from the
system Python of the same version, with a `.pth` pointing at this checkout's `src` and at the
project venv's site-packages (nothing is copied or installed). Not root: the script runs as the
current user with this interpreter.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.kits.confined_device import ensure_user

REPO = Path(__file__).resolve().parents[2]
USER = "tether-sbx"
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")

SCRIPT = r'''
import asyncio, json, os, secrets, sys, tempfile
from pathlib import Path

home = Path(os.environ["HOME"])
report = {"uid": os.getuid(), "home": str(home)}
secret = "tether-fake-token-" + secrets.token_hex(8)
os.environ["TETHER_DEVICE_TOKEN"] = secret
work = home / "tether-sbx-test"
state = home / ".local" / "state" / "tether"
outside = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-sbx-outside-"))  # writable by us, not a root

from tether.device.local import build_device
from tether.protocol.models import Command
from tether.tools.journal import UndoJournal
from tether.tools.policy.model import policy_from_mapping


async def main():
    work.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    (home / ".ssh").mkdir(mode=0o700, exist_ok=True)
    (home / ".ssh" / "id_test").write_text("KEY " + secret)
    victim, evil = work / "victim.txt", work / "evil.txt"
    victim.write_bytes(b"the user's own file\n\x00\xff")
    evil.write_bytes(b"evil\n")
    device = build_device(policy=policy_from_mapping({"private_tmp": True}), state_dir=state, sandbox=True)
    report["sandbox"] = None if device.context.sandbox is None else device.context.sandbox.kind
    try:
        await device.computer_manager.get_or_create(None)
        d = device.dispatcher(session_id="sbx")

        async def run(cmd, *argv, approved_by=None):
            [r] = await d.execute_commands([Command(tool_name="shell.run", approved_by=approved_by,
                                                    parameters={"cmd": cmd, "argv": list(argv), "cwd": str(work)})])
            return {"status": r.status.value, "error": r.error, "result": r.result}

        report["overwrite"] = await run("cp", str(evil), str(victim))
        report["victim_after_held"] = victim.read_bytes().hex()
        report["approved"] = await run("cp", str(evil), str(victim), approved_by="alice")
        report["victim_after_approval"] = victim.read_bytes().hex()
        report["undo"] = UndoJournal(state).restore("sbx", roots=device.policy.write_roots)
        report["victim_after_undo"] = victim.read_bytes().hex()
        report["outside"] = await run("cp", str(victim), str(outside / "x"))
        report["outside_exists"] = (outside / "x").exists()
        report["ssh"] = await run("ls", "-a", str(home / ".ssh"))
        report["ssh_key"] = await run("cat", str(home / ".ssh" / "id_test"))
        report["ps"] = await run("ps", "-eo", "pid,args")
        report["environ"] = await run("cat", f"/proc/{os.getpid()}/environ")
        mark = tempfile.gettempdir() + "/sbx-private-" + secrets.token_hex(4)  # the session's own /tmp
        report["tmp_touch"] = await run("touch", mark)
        [r] = await d.execute_commands([Command(tool_name="shell_execute_read",
                                                parameters={"command": "ls -a " + tempfile.gettempdir()})])
        report["tmp_read"] = {"status": r.status.value, "error": r.error, "result": r.result,
                              "mark": os.path.basename(mark), "on_machine": os.path.exists(mark)}
    finally:
        await device.aclose()
        for p in (work, outside, home / ".ssh" / "id_test"):
            if p.is_dir():
                import shutil
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink()
    report["secret"] = secret

asyncio.run(main())
print("REPORT " + json.dumps(report))
'''


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, **kw)


def _ensure_user() -> pwd.struct_passwd:
    """The user `tether-sbx`, created if missing (under the machine-wide lock of tests/kits/confined_device)."""
    return ensure_user(USER)


def _as_user_can(user: str, *test: str) -> bool:
    return _run(["runuser", "-u", user, "--", "test", *test]).returncode == 0


def _python_for(user: str, where: Path) -> str:
    """An interpreter `user` can run that imports tether and this venv's packages."""
    if _as_user_can(user, "-x", sys.executable) and _as_user_can(user, "-r", sys.executable):
        return sys.executable
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in SYSTEM_PYTHONS:
        if not os.access(candidate, os.X_OK):
            continue
        found = _run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).stdout.strip()
        if found != version:
            continue
        venv = where / "venv"
        made = _run([candidate, "-m", "venv", "--without-pip", str(venv)])
        assert made.returncode == 0, f"{candidate} -m venv failed: {made.stderr}"
        site = Path(_run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
                    .stdout.strip())
        ours = sysconfig.get_path("purelib")
        (site / "tether_checkout.pth").write_text(f"{REPO / 'src'}\nimport site; site.addsitedir({ours!r})\n")
        return str(venv / "bin/python")
    pytest.fail(f"{user} cannot run {sys.executable} (its directory is private) and no system Python {version} "
                f"was found in {SYSTEM_PYTHONS}; install it with: "
                f"apt-get install -y python{version} python{version}-venv")


def _check_readable(user: str) -> None:
    for path in (REPO / "src" / "tether" / "__init__.py", Path(sysconfig.get_path("purelib")) / "pydantic"):
        if not _as_user_can(user, "-r", str(path)):
            pytest.fail(f"{user} cannot read {path}: make the checkout and its venv world-readable "
                        f"(chmod -R o+rX {REPO}) to run this test")


def test_the_sandbox_holds_for_an_unprivileged_user(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.fail("bwrap is not installed; install it with: apt-get install -y bubblewrap")
    where = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-sbx-run-"))
    try:
        where.chmod(0o755)
        script = where / "device.py"
        script.write_text(SCRIPT)
        script.chmod(0o644)
        if os.geteuid() == 0:
            user = _ensure_user()
            if shutil.which("runuser") is None:
                pytest.fail("runuser is missing; install it with: apt-get install -y util-linux")
            _check_readable(user.pw_name)
            python = _python_for(user.pw_name, where)
            env = {"HOME": user.pw_dir, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
            argv = ["runuser", "-u", user.pw_name, "--", "env", "-i", *[f"{k}={v}" for k, v in env.items()],
                    python, str(script)]
        else:
            user = pwd.getpwuid(os.getuid())
            argv = [sys.executable, str(script)]
        done = _run(argv, cwd=where, timeout=240)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert line, f"the device script failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    report = json.loads(line.removeprefix("REPORT "))
    secret = report.pop("secret")
    assert report["uid"] == user.pw_uid and (report["uid"] != 0 or os.geteuid() != 0), report["uid"]
    assert report["sandbox"] and report["sandbox"].startswith("bwrap"), f"no sandbox as {user.pw_name}: {done.stderr}"

    problems = _problems(report, secret)
    assert not problems, f"as {user.pw_name} (uid {report['uid']}):\n- " + "\n- ".join(problems)


def _problems(report: dict[str, Any], secret: str) -> list[str]:
    """Every promise the report breaks, so one run shows them all."""
    out: list[str] = []

    def expect(ok: bool, what: str, detail: Any) -> None:
        if not ok:
            out.append(f"{what}: {json.dumps(detail)[:600]}")

    held = report["overwrite"]
    expect(held["status"] == "failure" and (held["result"] or {}).get("needs_approval") is True
           and held["result"]["rule"] == "approval.overwrite_outside_temp", "an overwrite was not held for approval",
           held)
    original = b"the user's own file\n\x00\xff".hex()
    expect(report["victim_after_held"] == original, "the held overwrite changed the file", report["victim_after_held"])
    approved = report["approved"]
    expect(approved["status"] == "success" and (approved["result"] or {}).get("applied_after_approval") is True,
           "the approved overwrite was not applied", approved)
    expect(report["victim_after_approval"] == b"evil\n".hex(), "the file after approval",
           report["victim_after_approval"])
    expect(report["victim_after_undo"] == original, "undo did not restore the file byte for byte", report["undo"])
    outside = report["outside"]
    expect(outside["status"] == "failure" and "Read-only file system" in (outside["error"] or ""),
           "a write outside the roots did not fail read-only", outside)
    expect(report["outside_exists"] is False, "a file was written outside the roots", report["outside_exists"])
    read = report["tmp_read"]
    expect(report["tmp_touch"]["status"] == "success" and read["status"] == "success"
           and read["mark"] in (read["result"] or {}).get("stdout", "") and read["on_machine"] is False,
           "a read-only command did not see its session's private /tmp", [report["tmp_touch"], read])
    ssh = report["ssh"]
    expect(ssh["status"] == "failure" and "No such file or directory" in (ssh["error"] or ""),
           "~/.ssh was not absent (an overlay whiteout below a captured root)", ssh)
    expect(report["ssh_key"]["status"] == "failure", "a key in ~/.ssh was readable", report["ssh_key"])
    ps = report["ps"]
    lines = ((ps["result"] or {}).get("stdout") or "").splitlines()[1:]
    expect(ps["status"] == "success" and len(lines) == 1 and lines[0].split(None, 1)[1].startswith("ps -eo"),
           "ps did not show only itself", ps)
    expect(report["environ"]["status"] == "failure", "the device's /proc/PID/environ was readable", report["environ"])
    expect(secret not in json.dumps(report), "the device's token leaked to a sandboxed command", "")
    return out
