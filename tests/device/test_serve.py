"""`tether.device.serve`: a device connected to a real in-process server, outside the CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from tests.kits.task import WAIT, AgentServer
from tether.device.config import parse_device_config
from tether.device.link.connection import DeviceConnection, LinkSettings, RegistrationRefused
from tether.device.serve import DeviceSetupError, ServedDevice, open_device, serve_device
from tether.protocol.models import ResultStatus


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_open_device_registers_runs_a_command_sent_over_rest_and_closes(tmp_path: Path) -> None:
    states: list[str] = []
    async with AgentServer(tmp_path) as server:
        token = server.store.tokens.create("device", "alpha")[1]
        hub = server.app.state.hub
        # the command's cwd, in /tmp: a write root of its own (not the session's private /tmp)
        roots = ["~", tempfile.gettempdir(), str(tmp_path)]
        config = parse_device_config({"device": {"policy": {"write_roots": roots}}})
        async with await open_device(f"ws://127.0.0.1:{server.port}", token=token, config=config,
                                     name="alpha", state_dir=tmp_path / "state", tags=["ci"],
                                     on_state=lambda state, conn: states.append(state)) as device:
            assert device.registered_as == "alpha" and states[-1] == "registered"
            answer = await server.api.post("/devices/alpha/commands", json={"commands": [
                {"tool_name": "shell.run", "parameters": {"cmd": "echo", "argv": ["hello"], "cwd": str(tmp_path)}}],
                "timeout": WAIT})
            assert answer.status_code == 200, answer.text
            [result] = answer.json()["results"]
            assert result["status"] == ResultStatus.SUCCESS.value and result["result"]["stdout"] == "hello\n"
            listed = (await server.api.get("/devices/alpha")).json()
            assert "ci" in listed["profile"]["tags"]
        assert states[-1] == "stopped"
        await hub.registry.wait_until(lambda: not hub.connected("alpha"), WAIT)
        await device.close()  # idempotent


async def test_open_device_raises_a_refusal_and_leaves_nothing_running(tmp_path: Path) -> None:
    async with AgentServer(tmp_path) as server:
        with pytest.raises(RegistrationRefused) as refused:
            await open_device(f"ws://127.0.0.1:{server.port}", token="tdev_not-a-real-token",
                              config=parse_device_config({}), name="alpha", state_dir=tmp_path / "state")
        assert refused.value.fatal


async def test_unusable_settings_are_a_device_setup_error(tmp_path: Path) -> None:
    with pytest.raises(DeviceSetupError, match="mix ws:// and wss://"):
        await open_device(["ws://127.0.0.1:1", "wss://127.0.0.1:2"], token="t", config=parse_device_config({}),
                          state_dir=tmp_path / "state")
    with pytest.raises(ValueError, match="not a wss:// URL"):  # a DeviceSetupError is a ValueError too
        await open_device("ws://127.0.0.1:1", token="t", config=parse_device_config({}), ca_file="ca.pem",
                          state_dir=tmp_path / "state")


async def test_serve_device_serves_until_its_stop_event_is_set(tmp_path: Path) -> None:
    async with AgentServer(tmp_path) as server:
        token = server.store.tokens.create("device", "beta")[1]
        hub = server.app.state.hub
        stop = threading.Event()
        ready: list[ServedDevice] = []
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                serve_device(f"ws://127.0.0.1:{server.port}", token=token, config=parse_device_config({}),
                             name="beta", state_dir=tmp_path / "state", on_ready=ready.append, stop=stop)
                outcome.append(None)
            except BaseException as exc:  # reported to the test below
                outcome.append(exc)

        thread = threading.Thread(target=run, name="serve_device")
        thread.start()
        try:
            await hub.registry.wait_until(lambda: hub.connected("beta"), WAIT)
            assert len(ready) == 1 and ready[0].urls == [f"ws://127.0.0.1:{server.port}/aip"]
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, WAIT)
        assert not thread.is_alive() and outcome == [None]
        await hub.registry.wait_until(lambda: not hub.connected("beta"), WAIT)


def test_serve_device_stops_on_sigterm(tmp_path: Path) -> None:
    """Run in the main thread (as `tether device` does) against a server that is not there: it retries
    until SIGTERM, then returns."""
    tried = threading.Event()

    def on_state(state: str, conn: DeviceConnection) -> None:
        if state == "disconnected" and not tried.is_set():
            tried.set()
            os.kill(os.getpid(), signal.SIGTERM)

    serve_device(f"ws://127.0.0.1:{_free_port()}", token="t", config=parse_device_config({}),
                 state_dir=tmp_path / "state", on_state=on_state,
                 settings=LinkSettings(backoff_base=0.01, backoff_cap=0.05))
    assert tried.is_set()


def test_the_device_process_freezes_its_start_up_once_at_the_first_registration() -> None:
    """`freeze_once_registered` (what `tether device` passes as `freeze_gc`): the objects alive at the first
    registration leave the collector's reach, those of later registrations do not; the caller's own hook
    still hears every state."""
    import gc

    from tether.device.serve import freeze_once_registered

    heard: list[str] = []
    hook = freeze_once_registered(lambda state, conn: heard.append(state))
    link = object()
    assert gc.get_freeze_count() == 0  # nothing else in this process froze: a real before
    try:
        hook("connecting", link)  # type: ignore[arg-type]
        assert gc.get_freeze_count() == 0
        hook("registered", link)  # type: ignore[arg-type]
        frozen = gc.get_freeze_count()
        assert frozen > 0
        later = [[i] for i in range(1000)]  # new objects, alive at the next registration
        hook("disconnected", link)  # type: ignore[arg-type]
        hook("registered", link)  # type: ignore[arg-type]
        # nothing new frozen (frozen objects freed meanwhile may lower the count; 1,000 new ones would raise it)
        assert gc.get_freeze_count() <= frozen and later
    finally:
        gc.unfreeze()
    assert heard == ["connecting", "registered", "disconnected", "registered"]
