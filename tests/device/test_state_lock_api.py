"""The Python API's devices hold their state directory as the `tether` commands do: `open_local_device`,
`open_device` and `serve_device` take its lock before anything in it is read and keep it until closed. Against
another process holding it (a real process with the real lock, as a `tether device` holds it) each raises
`StateDirBusy` naming it, having touched nothing there and connected nowhere; while an API device is open, a real
`tether exec` on its state directory is refused in one line naming it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from tests.kits.netutil import CLI
from tests.kits.state_holder import holder, release
from tether.device.config import parse_device_config
from tether.device.local import StateDirBusy, hold_state_dir, open_local_device
from tether.device.serve import open_device, serve_device

UNREACHABLE = "ws://127.0.0.1:9"  # nothing listens: a device that got past the lock would try it and wait


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_api_devices_are_refused_a_state_directory_another_process_holds(tmp_path: Path) -> None:
    state = tmp_path / "state"
    device = holder(state, "tether device")
    try:
        before = files(state)

        async def local() -> None:
            async with open_local_device(parse_device_config({}, "test"), state_dir=state, sandbox=False):
                raise AssertionError("opened a device on a state directory another process holds")

        async def served() -> None:
            await open_device(UNREACHABLE, token="t", state_dir=state, register_timeout=60)

        for attempt in (local, served):
            with pytest.raises(StateDirBusy) as busy:
                asyncio.run(attempt())
            assert (busy.value.holder, busy.value.pid, busy.value.directory) == ("tether device", device.pid, state)
            assert f"another tether device (pid {device.pid}) already uses the state directory {state}" in str(
                busy.value)
        with pytest.raises(StateDirBusy):
            serve_device(UNREACHABLE, token="t", state_dir=state, handle_signals=False)
        assert files(state) == before  # no key, probe, journal or kept policy read into being
    finally:
        release(device)


def test_an_open_api_device_holds_its_state_directory_until_closed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "OPENAI_"))},
           "TETHER_ALLOW_ROOT": "1", "HOME": str(tmp_path)}

    async def main() -> None:
        async with open_local_device(parse_device_config({}, "test"), state_dir=state, sandbox=False):
            assert (state / "device.lock").read_text() == f"{os.getpid()} tether API user\n"
            ran = await asyncio.to_thread(
                subprocess.run, [*CLI, "exec", "get_system_info", "info_type=os", "--state-dir", str(state)],
                capture_output=True, text=True, timeout=120, env=env)
            assert ran.returncode == 2, (ran.stdout, ran.stderr)
            [line] = [each for each in ran.stderr.splitlines() if not each.startswith("warning: running as root")]
            assert line.startswith(f"error: another tether API user (pid {os.getpid()}) already uses the state "
                                   f"directory {state} ("), line

    asyncio.run(main())
    os.close(hold_state_dir(state, "tether exec"))  # closed: given up
