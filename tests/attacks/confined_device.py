"""A real device with a real bubblewrap sandbox, driven through its dispatcher as an agent would drive it:
shared by the containment attacks (IPC out of the sandbox, resource limits)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tether.device.local import LocalDevice, build_device
from tether.protocol.models import Command, Result
from tether.tools.policy import policy_from_mapping

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
