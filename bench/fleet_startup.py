"""Start-up of tether's processes, each against a bare-interpreter anchor measured in the same run.

    python -m bench.fleet_startup [REPEATS]

Rows (issue 13's table):
- `tether --help` against `python -c pass`;
- `tether exec get_system_info info_type=os` (local mode: no server) against `python -c pass`;
- `tether server` (an existing empty database, no LLM) spawn -> the first 200 of `/api/v1/health`, against
  the same for a bare uvicorn + FastAPI app with that one route: the framework's own start-up floor.
  Across processes there is no "started" event, so both are probed every 5 ms;
- `tether device` launch -> registered, against a Python process that imports `websockets` and does one
  echo round trip with a `websockets` echo server on 127.0.0.1; and the same device with one external stdio
  MCP server configured (bench/echo_server.py), which joins after registration. The device talks to a
  real `tether server` started once on a free port; its time is from spawn to the "registered as" line on
  its stderr (printed when the server's register-ack arrives), then it is stopped with SIGTERM and reaped
  before the next run.

Each repetition runs anchor and subject back to back (interleaved), the order alternating; every figure is
the median of REPEATS with the spread (min..max) beside it. Wall-clock of whole processes, with
bytecode cached (a warm-up run of each fills a private PYTHONPYCACHEPREFIX), as an installed package runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench._stats import fleet_row, spread

PY = sys.executable
TETHER = [PY, "-m", "tether.cli"]
WAIT = 60.0  # upper bound on any one process; a run that takes longer is a failure, not a figure
HEALTH = "/api/v1/health"
BARE_SERVER = ("import sys\nimport uvicorn\nfrom fastapi import FastAPI\napp = FastAPI()\n"
               f"@app.get({HEALTH!r})\nasync def health() -> dict:\n    return {{'status': 'ok'}}\n"
               "uvicorn.run(app, host='127.0.0.1', port=int(sys.argv[1]), log_level='warning')\n")
ECHO_CLIENT = ("import sys\nfrom websockets.sync.client import connect\n"
               "with connect(sys.argv[1], compression=None) as ws:\n"
               "    ws.send('ping')\n    assert ws.recv() == 'ping'\n")


def _env(state: Path) -> dict[str, str]:
    """Bytecode cached as in an installed package (pip compiles it), in a prefix under `state` so the
    tree stays clean: with PYTHONDONTWRITEBYTECODE set, every run would compile tether from source."""
    env = {k: v for k, v in os.environ.items() if (not k.startswith("TETHER_") and k != "PYTHONDONTWRITEBYTECODE")
           or k in ("TETHER_ALLOW_ROOT", "TETHER_RUN_AS")}  # a root device's leave (docs/security/root.md)
    return {**env, "TETHER_STATE_DIR": str(state), "NO_COLOR": "1", "COLUMNS": "120",
            "PYTHONPYCACHEPREFIX": str(state / "pycache")}


async def _run(argv: list[str], env: dict[str, str]) -> float:
    """Seconds from spawn to exit of a process whose output is thrown away; it must exit 0."""
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), WAIT)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[2:]} exited {proc.returncode}: {err.decode(errors='replace')[-500:]}")
    return elapsed


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _health_ok(port: int) -> bool:
    """One GET of /api/v1/health: True on a 200, False while nothing listens yet."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    try:
        writer.write(f"GET {HEALTH} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        status = await asyncio.wait_for(reader.readline(), WAIT)
        return status.split(b" ")[1:2] == [b"200"]
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()


async def _to_health(argv: list[str], port: int, env: dict[str, str]) -> float:
    """Seconds from spawning a server to its first 200 on /api/v1/health; then it is stopped and reaped."""
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        while not await _health_ok(port):  # no "started" event across processes: probed, bounded by WAIT
            if proc.returncode is not None or time.perf_counter() - start > WAIT:
                err = await proc.stderr.read() if proc.stderr is not None and proc.returncode is not None else b""
                raise RuntimeError(f"{argv[2:4]} did not answer {HEALTH}: {err.decode(errors='replace')[-500:]}")
            await asyncio.sleep(0.005)
        return time.perf_counter() - start
    finally:
        await _stop(proc)
        if proc.stderr is not None:
            await proc.stderr.read()


async def _until_line(proc: asyncio.subprocess.Process, marker: bytes) -> None:
    assert proc.stderr is not None
    seen = b""
    while True:
        line = await proc.stderr.readline()
        if not line:
            raise RuntimeError(f"the device exited ({await proc.wait()}) before {marker!r}: {seen[-800:]!r}")
        seen += line
        if marker in line:
            return


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), WAIT)
        except TimeoutError:
            proc.kill()
            await proc.wait()


class _Server:
    """A real `tether server` on a free port with one device token, for the device rows."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.proc: asyncio.subprocess.Process | None = None
        self.port = 0
        self.secret = ""

    async def start(self) -> None:
        from tether.server.store import Store  # only the device rows need a server

        db = self.tmp / "server.db"
        store = Store(str(db))
        _, self.secret = store.tokens.create("device", "bench", [])
        store.close()
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.proc = await asyncio.create_subprocess_exec(
            *TETHER, "server", "--port", str(self.port), "--db", str(db), "--log-level", "info",
            env=_env(self.tmp), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
        await asyncio.wait_for(_until_line(self.proc, b"Uvicorn running on"), WAIT)
        self._drain = asyncio.ensure_future(self._drain_stderr())

    async def _drain_stderr(self) -> None:  # a full pipe would stall the server
        assert self.proc is not None and self.proc.stderr is not None
        while await self.proc.stderr.read(65536):
            pass

    async def device(self, config: Path | None = None) -> float:
        """Seconds from spawning `tether device` (with this config file) to its "registered as" line."""
        env = {**_env(self.tmp), "TETHER_DEVICE_TOKEN": self.secret}
        extra = ["--config", str(config)] if config else []
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *TETHER, "device", "--server", f"ws://127.0.0.1:{self.port}", "--name", "bench", *extra,
            "--state-dir", str(self.tmp / "device"), env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            await asyncio.wait_for(_until_line(proc, b"registered as"), WAIT)
            return time.perf_counter() - start
        finally:
            await _stop(proc)

    async def aclose(self) -> None:
        if self.proc is not None:
            await _stop(self.proc)
            self._drain.cancel()


async def _pairs(repeats: int, anchor: Callable[[], Awaitable[float]], subject: Callable[[], Awaitable[float]]
                 ) -> tuple[list[float], list[float]]:
    await anchor()  # warm the page cache and the .pyc files
    await subject()
    anchors: list[float] = []
    subjects: list[float] = []
    for i in range(repeats):
        if i % 2:
            subjects.append(await subject())
            anchors.append(await anchor())
        else:
            anchors.append(await anchor())
            subjects.append(await subject())
    return anchors, subjects


async def measure_async(repeats: int) -> list[dict[str, object]]:
    from websockets.asyncio.server import serve

    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="tether-bench-startup-") as tmp_name:
        tmp = Path(tmp_name)
        env = _env(tmp)
        bare = [PY, "-c", "pass"]

        async def python_pass() -> float:
            return await _run(bare, env)

        async def help_() -> float:
            return await _run([*TETHER, "--help"], env)

        anchors, subjects = await _pairs(repeats, python_pass, help_)
        rows.append(_row("tether --help", subjects, "python -c pass", anchors, "<= 0.15 s"))

        async def exec_() -> float:
            return await _run([*TETHER, "exec", "get_system_info", "info_type=os"], env)

        anchors, subjects = await _pairs(repeats, python_pass, exec_)
        rows.append(_row("tether exec get_system_info (local)", subjects, "python -c pass", anchors, "<= 0.5 s"))

        db = tmp / "start.db"  # made by the warm-up run, empty after it: each timed start opens it

        async def bare_server() -> float:
            port = _free_port()
            return await _to_health([PY, "-c", BARE_SERVER, str(port)], port, env)

        async def tether_server() -> float:
            port = _free_port()
            return await _to_health([*TETHER, "server", "--port", str(port), "--db", str(db), "--log-level",
                                     "warning"], port, env)

        anchors, subjects = await _pairs(repeats, bare_server, tether_server)
        rows.append(_row("tether server start -> /health (empty db)", subjects, "bare uvicorn+FastAPI",
                         anchors, "<= 1 s"))

        async def echo(ws: object) -> None:
            async for message in ws:  # type: ignore[attr-defined]
                await ws.send(message)  # type: ignore[attr-defined]

        server = _Server(tmp)
        async with serve(echo, "127.0.0.1", 0, compression=None) as echo_server:
            port = next(iter(echo_server.sockets)).getsockname()[1]

            async def ws_echo() -> float:
                return await _run([PY, "-c", ECHO_CLIENT, f"ws://127.0.0.1:{port}"], env)

            # one external stdio MCP server (bench/echo_server.py): it starts after the device has registered
            config = tmp / "device-mcp.yaml"
            config.write_text(json.dumps({"mcpServers": {"echo": {
                "command": PY, "args": [str(Path(__file__).resolve().parent / "echo_server.py")]}}}))
            try:
                await server.start()

                async def device() -> float:
                    return await server.device()

                async def device_mcp() -> float:
                    return await server.device(config)

                anchors, subjects = await _pairs(repeats, ws_echo, device)
                mcp_anchors, mcp_subjects = await _pairs(repeats, ws_echo, device_mcp)
            finally:
                await server.aclose()
        rows.append(_row("tether device launch -> registered", subjects, "python websockets + 1 echo",
                         anchors, "<= 0.4 s"))
        rows.append(_row("  the same, one external stdio MCP server", mcp_subjects, "python websockets + 1 echo",
                         mcp_anchors, "<= 0.4 s"))
    return rows


def _row(figure: str, subjects: list[float], anchor_name: str, anchors: list[float], goal: str
         ) -> dict[str, object]:
    return fleet_row(figure, statistics.median(subjects), "s", anchor_name, statistics.median(anchors), goal,
                     f"spread {spread(subjects)} s, anchor {spread(anchors)} s, n={len(subjects)}")


def measure(repeats: int) -> list[dict[str, object]]:
    """Every start-up row, `repeats` interleaved runs each (for `bench/fleet.py`)."""
    return asyncio.run(measure_async(repeats))


if __name__ == "__main__":
    measure(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
