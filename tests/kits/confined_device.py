"""A real device with a real bubblewrap sandbox, driven through its dispatcher as an agent would drive it:
shared by the containment attacks (IPC out of the sandbox, resource limits)."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tether.device.local import LocalDevice, build_device
from tether.protocol.models import Command, Result
from tether.tools.policy.model import policy_from_mapping

SYSTEM_PYTHON = "/usr/bin/python3"  # outside every write root, and not a pyenv shim


def require(program: str, package: str) -> str:
    """The program's path; a missing one fails the test with the command that installs it."""
    path = shutil.which(program)
    if path is None:
        pytest.fail(f"{program} is not installed; install it with: apt-get install -y {package}")
    return path


@dataclass
class Attacker:
    device: LocalDevice
    home: Path

    async def run(self, cmd: str, *argv: str, session: str = "attack", **params: Any) -> Result:
        dispatcher = self.device.dispatcher(session_id=session)
        [result] = await dispatcher.execute_commands([Command(
            tool_name="shell.run", parameters={"cmd": cmd, "argv": list(argv), "cwd": str(self.home), **params})])
        return result

    async def python(self, code: str, **params: Any) -> Result:
        return await self.run(SYSTEM_PYTHON, "-c", code, **params)


@dataclass
class SessionCaller:
    """Calls into `device` as one agent session (`session`), with `home` as the default working directory of its
    shell commands; `approved_by` stands for a person's approval where a test gives one."""

    device: LocalDevice
    home: Path
    session: str

    async def call(self, tool: str, approved_by: str | None = None, **params: Any) -> Result:
        dispatcher = self.device.dispatcher(session_id=self.session)
        [result] = await dispatcher.execute_commands([Command(tool_name=tool, parameters=params,
                                                              approved_by=approved_by)])
        return result

    async def run(self, cmd: str, *argv: str, cwd: Path | None = None, approved_by: str | None = None,
                  **params: Any) -> Result:
        return await self.call("shell.run", approved_by=approved_by, cmd=cmd, argv=list(argv),
                               cwd=str(cwd or self.home), **params)


def text(result: Result) -> str:
    return (result.error or "") + "\n" + json.dumps(result.result)


def stdout(result: Result) -> str:
    return (result.result or {}).get("stdout", "") if isinstance(result.result, dict) else ""


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh HOME under /var/tmp (outside the temp dir): the device's write roots are it and /tmp."""
    require("bwrap", "bubblewrap")
    path = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-attack-home-")).resolve()
    monkeypatch.setenv("HOME", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def outside() -> Any:
    """A directory outside every write root, where the machine's own sockets live in these tests."""
    path = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-attack-outside-")).resolve()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def attacker_factory(home: Path) -> AsyncIterator[Callable[..., Any]]:
    devices: list[LocalDevice] = []

    async def make(**policy: Any) -> Attacker:
        state = home / ".local/state/tether"
        state.mkdir(parents=True, exist_ok=True)
        device = build_device(policy=policy_from_mapping(policy), state_dir=state, sandbox=True)
        devices.append(device)
        assert device.context.sandbox is not None, "no sandbox was made here (see the log for why)"
        await device.computer_manager.get_or_create(None)
        return Attacker(device, home)

    yield make
    for device in devices:
        await device.aclose()


# ------------------------------------------------------------------------------------ as an ordinary user

UNPRIVILEGED_USER = "tether-sbx"
REPO = Path(__file__).resolve().parents[2]


def _quiet(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, **kw)


USERADD_LOCK = Path("/run/lock/tether-tests-useradd.lock") if Path("/run/lock").is_dir() \
    else Path(tempfile.gettempdir()) / "tether-tests-useradd.lock"


def ensure_user(name: str = UNPRIVILEGED_USER) -> pwd.struct_passwd:
    """The account `name`, created (`useradd -m`) if it is missing. The suite runs in several processes at
    once (pytest-xdist workers, the SQLite and PostgreSQL passes): the check-then-create is done under an
    exclusive lock on a file every process shares, so two tests never both see it missing and race
    useradd (the loser failed "user already exists" or "cannot lock /etc/passwd")."""
    import fcntl

    with contextlib.suppress(KeyError):
        return pwd.getpwnam(name)
    require("useradd", "passwd")
    with open(USERADD_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
        made = _quiet(["useradd", "-m", "-s", "/bin/sh", name])
        assert made.returncode == 0, f"useradd -m {name} failed: {made.stderr}"
        return pwd.getpwnam(name)


def _python_for(user: str, where: Path) -> str:
    """An interpreter `user` can run that imports tether: this one, or a venv of the system Python of the
    same version pointing (.pth) at this checkout and this venv's packages (nothing copied)."""
    if _quiet(["runuser", "-u", user, "--", "test", "-x", sys.executable]).returncode == 0:
        return sys.executable
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.access(candidate, os.X_OK) or _quiet(
                [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).stdout.strip() != version:
            continue
        venv = where / "venv"
        made = _quiet([candidate, "-m", "venv", "--without-pip", str(venv)])
        assert made.returncode == 0, f"{candidate} -m venv failed: {made.stderr}"
        site = Path(_quiet([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
                    .stdout.strip())
        ours = sysconfig.get_path("purelib")
        (site / "tether_checkout.pth").write_text(f"{REPO / 'src'}\nimport site; site.addsitedir({ours!r})\n")
        return str(venv / "bin/python")
    pytest.fail(f"{user} cannot run {sys.executable} and no system Python {version} was found; install it with: "
                f"apt-get install -y python{version} python{version}-venv")


def run_unprivileged(script: str, timeout: float = 240) -> dict[str, Any]:
    """Run `script` (Python that prints one `REPORT {json}` line) as an ordinary user: `tether-sbx`, created
    if missing, when the tests run as root; the current user otherwise. Returns the report."""
    where = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-sbx-run-"))
    try:
        where.chmod(0o755)
        path = where / "device.py"
        path.write_text(script)
        path.chmod(0o644)
        if os.geteuid() == 0:
            require("runuser", "util-linux")
            user = ensure_user()
            python = _python_for(user.pw_name, where)
            env = {"HOME": user.pw_dir, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
            argv = ["runuser", "-u", user.pw_name, "--", "env", "-i", *[f"{k}={v}" for k, v in env.items()],
                    python, str(path)]
        else:
            argv = [sys.executable, str(path)]
        done = _quiet(argv, cwd=where, timeout=timeout)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert line, f"the device script failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    report: dict[str, Any] = json.loads(line.removeprefix("REPORT "))
    assert report["uid"] != 0, "the unprivileged run ran as root"
    return report
