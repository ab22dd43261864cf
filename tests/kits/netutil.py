"""Helpers for tests that run real server and device processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.kit import ports
from tests.kits import db as dbkit
from tether.client.rest import RemoteServer

CLI = [sys.executable, "-m", "tether.cli"]


def free_port() -> int:
    """A port for a server process about to start; parallel-safe (bench/kit/ports.py)."""
    return ports.free_port()


def wait_for(check: Callable[[], object], what: str, timeout: float = 30.0,
             procs: tuple[subprocess.Popen, ...] = ()) -> object:
    """Poll a condition that lives in another process (no event can cross to us); fail with context."""
    end = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < end:
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"{what}: process {proc.args!r} exited with {proc.returncode}")
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # the other process may not be up yet
            last_error = exc
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what} (last error: {last_error})")


class Proc:
    """A `tether` sub-process whose output is collected to a file (so a full pipe never blocks it)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self._file = log.open("wb")
        self.popen = subprocess.Popen([*CLI, *args], stdout=self._file, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        self._file.flush()
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 15) -> int:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._file.close()
        return self.popen.returncode

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()


def tether_env(state: Path) -> dict[str, str]:
    return {**os.environ, "TETHER_STATE_DIR": str(state), "NO_COLOR": "1", "COLUMNS": "200"}


class TcpProxy:
    """A loopback TCP proxy the test can cut: drops every live connection, keeps listening."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.accepted = 0

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    def cut(self) -> None:
        for writer in list(self._writers):
            transport = writer.transport
            transport.abort()
        self._writers.clear()

    async def aclose(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


STARTUP_WAIT = 120.0  # upper bound for a `tether server` process to answer /health
# A test server's liveness options: beats every 0.3 s and a dropped device's batches kept 3 s, but a generous 20 s
# heartbeat timeout, so a scheduling stall of a loaded CI machine (seconds, seen at load 16) is not taken for a
# silent device. A test about silence itself (a device or link that stops answering without closing its socket)
# asks for `SHORT_HEARTBEAT` explicitly: `Cluster(tmp, heartbeat=SHORT_HEARTBEAT)`.
HEARTBEAT = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "20", "--grace-period", "3"]
SHORT_HEARTBEAT = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "2", "--grace-period", "3"]


def workspace_roots(tmp: Path) -> str:
    """The YAML line naming the default write roots and `tmp` (a test's workspace in pytest's temp dir, the
    machine's rather than each session's private /tmp), for a policy file a test writes itself."""
    return f"write_roots: {json.dumps(['~', tempfile.gettempdir(), str(tmp)])}\n"


def workspace_policy(tmp: Path, **more: Any) -> Path:
    """A device policy file (in `tmp`) with the default write roots and `tmp` itself: a test's workspace in pytest's
    temp dir is then the machine's, as a user's project is, not each session's private /tmp. `more`: other
    settings."""
    path = tmp / "workspace-policy.json"
    path.write_text(json.dumps({"write_roots": ["~", tempfile.gettempdir(), str(tmp)], **more}))
    return path


@dbkit.keeps_server_state
class Cluster:
    """One server process (`server_args`: more `tether server` options, e.g. --four-eyes) plus whatever
    devices a test starts; everything stopped at the end. `heartbeat`: its liveness options (`HEARTBEAT`, with
    a generous timeout; a test about a silent device passes `SHORT_HEARTBEAT`)."""

    def __init__(self, tmp: Path, server_args: tuple[str, ...] = (), heartbeat: list[str] | None = None) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        self.state.mkdir()
        self.db = self.state / "server.db"
        self.env = tether_env(self.state)
        self.api_token, self.read_token, *devices = dbkit.create_tokens(dbkit.server_db(self.db), [
            ("api", "tests", ["read", "execute", "admin"]), ("api", "reader", ["read"]),
            ("device", "alpha", []), ("device", "beta", [])])
        self.device_tokens = dict(zip(("alpha", "beta"), devices, strict=True))
        self.port = free_port()
        self.procs: list[Proc] = []
        self.server = self.start(["server", "--port", str(self.port), *dbkit.server_db_args(self.db),
                                  *(HEARTBEAT if heartbeat is None else heartbeat),
                                  "--log-level", "warning", *server_args], "server")
        self.remote = RemoteServer(f"http://127.0.0.1:{self.port}", self.api_token)
        try:
            # a bound, not a delay: with parallel workers on 2 cores a server process can take long to start
            wait_for(lambda: self.remote.health()["status"] == "ok", "server health", STARTUP_WAIT,
                     procs=(self.server.popen,))
        except BaseException:
            self.close()  # the fixture never gets it to close: the server process must not outlive the test
            raise

    def start(self, args: list[str], label: str, env: dict[str, str] | None = None) -> Proc:
        proc = Proc(args, self.tmp / f"{label}-{len(self.procs)}.log", {**self.env, **(env or {})})
        self.procs.append(proc)
        return proc

    def device(self, name: str, token: str | None = None, port: int | None = None, extra: tuple[str, ...] = (),
               env: dict[str, str] | None = None, state_dir: Path | None = None) -> Proc:
        """A `tether device` process; its token travels in TETHER_DEVICE_TOKEN, never on its command line. Without
        a `--policy` in `extra`, its policy is the default with the test's directory as a write root of its own
        (`workspace_policy`). Its state directory is `state_dir`, by default one per name (a device process
        holds its state directory alone)."""
        if "--policy" not in extra:
            extra = (*extra, "--policy", str(workspace_policy(self.tmp)))
        args = ["device", "--server", f"ws://127.0.0.1:{port or self.port}", "--name", name,
                "--state-dir", str(state_dir or self.state / f"dev-{name}"), *extra]
        secret = token if token is not None else self.device_tokens.get(name)
        return self.start(args, f"device-{name}", {**({"TETHER_DEVICE_TOKEN": secret} if secret else {}),
                                                   **(env or {})})

    def status(self, name: str) -> str | None:
        for row in self.remote.devices():
            if row["name"] == name:
                return row["status"]
        return None

    def wait_online(self, name: str, proc: Proc, timeout: float = 60) -> None:
        wait_for(lambda: self.status(name) in ("online", "busy"), f"{name} online", timeout, (proc.popen,))

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.remote.close()
