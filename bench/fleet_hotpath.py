"""The REST command hot path: commands/s with 10 devices in a closed loop, and server CPU per command.

    python -m bench.fleet_hotpath [--devices 10] [--callers 16] [--seconds 3] [--repeats 3] [--quick]

A real `tether server` (SQLite store in a temp directory, uvicorn with its default `loop="auto"`,
`http="auto"`: uvloop and httptools when installed) and one client process holding 10 of tether's own
`DeviceConnection`s, each registered with its own device token. C callers, each on one keep-alive HTTP/1.1
connection, post one cheap command per batch (`list_tools` of a namespace no tool has: no thread, no
I/O) to `POST /api/v1/devices/{name}/commands` as fast as the answers come back. The callers speak raw
HTTP/1.1 over asyncio streams (one prepared request, a minimal response parser) so that the load
generator, which shares the two cores, costs as little as it can.

Anchors, measured in the same run and interleaved round by round with the subject:
- a bare uvicorn + Starlette route in a child process (same uvicorn defaults, same callers, a JSON body
  parsed and one answered): requests/s and its CPU per request;
- a raw `websockets` echo across processes (bench.roundtrip's echo server): round trips/s, one connection.
Server CPU is the server process's user+system CPU time delta over the round, divided by the answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import psutil

from bench._stats import fleet_row, spread
from bench.kit.procs.fleet import CHEAP, cpu_s, device_process, free_port, raise_fd_limit, server_process

BODY = json.dumps({"commands": [CHEAP], "timeout": 30}).encode()


def request_bytes(path: str, token: str | None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One HTTP/1.1 response: (status, body), Content-Length or chunked."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        return status, await reader.readexactly(int(headers["content-length"]))
    body = bytearray()
    while True:  # chunked
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return status, bytes(body)
        body += await reader.readexactly(size)
        await reader.readexactly(2)


async def caller(port: int, requests: list[bytes], until: float, errors: list[str]) -> int:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
    done = 0
    try:
        while time.perf_counter() < until:
            writer.write(requests[done % len(requests)])
            status, body = await asyncio.wait_for(read_response(reader), 60)
            if status != 200 or b'"status":"success"' not in body:
                errors.append(f"{status} {body[:200]!r}")
            done += 1
    finally:
        writer.close()
    return done


async def closed_loop(port: int, requests: list[list[bytes]], seconds: float, proc: psutil.Process,
                      errors: list[str]) -> tuple[float, float]:
    """(answers per second, server CPU seconds per answer) of `len(requests)` callers for `seconds`."""
    cpu0, t0 = cpu_s(proc), time.perf_counter()
    counts = await asyncio.gather(*(caller(port, r, t0 + seconds, errors) for r in requests))
    elapsed, cpu = time.perf_counter() - t0, cpu_s(proc) - cpu0
    total = sum(counts)
    return total / elapsed, cpu / max(total, 1)


# ---------------------------------------------------------------------------------------------- the bare route

def bare_main(port: int) -> None:
    """`--peer bare PORT`: uvicorn (its defaults) serving one Starlette route that parses a JSON body and
    answers a small JSON result, as a command's answer is."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def run(request: Request) -> JSONResponse:
        batch = await request.json()
        return JSONResponse({"device": "bare", "results": [{"status": "success", "result": [],
                                                            "call_id": str(len(batch["commands"]))}]})

    app = Starlette(routes=[Route("/x", run, methods=["POST"])])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    print("ready", flush=True)  # the socket is bound: connections wait in its backlog until accepted
    server.run(sockets=[sock])


def server_main(db: str, port: int, loop: str, http: str) -> None:
    """`--peer server DB PORT LOOP HTTP`: `tether server` as `run_server` builds it, with uvicorn's event loop
    and HTTP parser chosen (`auto` picks uvloop and httptools when installed; `asyncio`/`h11` are the
    pure-Python ones), to measure what the speed-ups give."""
    from tether.server.main import build_config, make_server
    from tether.server.settings import ServerSettings

    config = build_config(ServerSettings(db_path=Path(db), port=port), log_level="warning")
    config.loop = loop  # type: ignore[assignment]
    if http != "auto":  # "auto" keeps what `tether server` runs: httptools behind the coalescing transport
        config.http = http  # type: ignore[assignment]
    make_server(config).run()


@asynccontextmanager
async def stack_server(tmp: Path, port: int, loop: str, http: str) -> AsyncIterator[psutil.Process]:
    """The server with a chosen loop/parser; yields once /api/v1/health answers."""
    import httpx

    with (tmp / f"server-{loop}.log").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.fleet_hotpath", "--peer", "server",
                                                    str(tmp / "server.db"), str(port), loop, http,
                                                    stdout=log, stderr=log)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                for _ in range(600):  # uvicorn offers no event for "started" across processes
                    if proc.returncode is not None:
                        raise RuntimeError(f"the server exited: {(tmp / f'server-{loop}.log').read_text()[-2000:]}")
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get("/api/v1/health")).status_code == 200:
                            break
                    await asyncio.sleep(0.05)
            yield psutil.Process(proc.pid)
        finally:
            proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 30)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@asynccontextmanager
async def bare_process(port: int) -> AsyncIterator[psutil.Process]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.fleet_hotpath", "--peer", "bare",
                                                str(port), stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line.startswith(b"ready"):
            raise RuntimeError("the bare uvicorn route did not start")
        yield psutil.Process(proc.pid)
    finally:
        proc.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 15)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def echo_rate(ws: object, frame: str, seconds: float) -> float:
    until, n, t0 = time.perf_counter() + seconds, 0, time.perf_counter()
    while time.perf_counter() < until:
        await ws.send(frame)  # type: ignore[attr-defined]
        await ws.recv()  # type: ignore[attr-defined]
        n += 1
    return n / (time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------- measure

async def _measure(devices: int, callers: int, seconds: float, repeats: int,
                   stack: str = "auto") -> list[dict[str, object]]:
    from websockets.asyncio.client import connect

    from bench.roundtrip import command_frame, far_end
    from tether.server.store import Store

    raise_fd_limit()
    stack_choice = stack
    with tempfile.TemporaryDirectory(prefix="tether-hotpath-") as tmp_name:
        tmp = Path(tmp_name)
        store = Store(str(tmp / "server.db"))
        names = [f"hot-{i:03d}" for i in range(devices)]
        tokens = {n: store.tokens.create("device", n)[1] for n in names}
        api = store.tokens.create("api", "hotpath", ["read", "execute"])[1]
        store.close()
        port, bare_port = free_port(), free_port()
        errors: list[str] = []
        async with contextlib.AsyncExitStack() as stack:
            if stack_choice == "auto":
                server = await stack.enter_async_context(server_process(tmp, port))
            else:
                loop, http = stack_choice.split(",")
                server = await stack.enter_async_context(stack_server(tmp, port, loop, http))
            await stack.enter_async_context(device_process(f"ws://127.0.0.1:{port}/aip", tmp / "devices", tokens,
                                                           tmp / "devices.log"))
            bare = await stack.enter_async_context(bare_process(bare_port))
            echo_port = await stack.enter_async_context(far_end(True, "echo-server"))
            ws = await stack.enter_async_context(connect(f"ws://127.0.0.1:{echo_port}", compression=None,
                                                         max_size=None, ping_interval=None))
            frame = command_frame()
            tether_reqs = [[request_bytes(f"/api/v1/devices/{names[(c + k) % devices]}/commands", api)
                            for k in range(devices)] for c in range(callers)]
            bare_reqs = [[request_bytes("/x", None)] for _ in range(callers)]
            warm = min(1.0, seconds)
            await closed_loop(port, tether_reqs, warm, server, errors)
            await closed_loop(bare_port, bare_reqs, warm, bare, [])
            rates, cpus, bare_rates, bare_cpus, echoes = [], [], [], [], []
            for _ in range(repeats):  # interleaved: anchor, subject, echo, every round
                rate, cpu = await closed_loop(bare_port, bare_reqs, seconds, bare, errors)
                bare_rates.append(rate)
                bare_cpus.append(cpu)
                rate, cpu = await closed_loop(port, tether_reqs, seconds, server, errors)
                rates.append(rate)
                cpus.append(cpu)
                echoes.append(await echo_rate(ws, frame, seconds))
    if errors:
        raise RuntimeError(f"{len(errors)} failed commands, e.g. {errors[:3]}")
    note = f"{devices} devices, {callers} callers, {repeats}x{seconds:g}s, server loop/http {stack_choice}"
    rate, cpu = statistics.median(rates), statistics.median(cpus) * 1e3
    return [
        fleet_row("REST commands/s, closed loop", rate, "/s", "websockets echo /s",
                  statistics.median(echoes), ">= 3000/s", f"{note}; spread {spread(rates)}"),
        fleet_row("REST commands/s vs a bare uvicorn+Starlette route", rate, "/s", "bare route /s",
                  statistics.median(bare_rates), ">= 3000/s", f"bare spread {spread(bare_rates)}"),
        fleet_row("server CPU per REST command", cpu, "ms", "bare route CPU/req",
                  statistics.median(bare_cpus) * 1e3, "<= 0.3 ms", f"spread {spread([c * 1e3 for c in cpus])}"),
    ]


def measure(devices: int = 10, callers: int = 16, seconds: float = 3.0, repeats: int = 3,
            quick: bool = False) -> list[dict[str, object]]:
    """The hot path's rows for bench/fleet.py (`devices` is the fleet size of the other benches: this one
    always uses at most 10 devices, the issue's figure)."""
    if quick:
        seconds, repeats, callers = 0.5, 1, 4
    return asyncio.run(_measure(min(devices, 10), callers, seconds, repeats))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--peer":
        if sys.argv[2] == "server":
            server_main(sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])
        else:
            bare_main(int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--stack", default="auto", help="the server's uvicorn loop,http: auto (uvloop and "
                                                         "httptools when installed) or e.g. asyncio,h11")
    args = parser.parse_args()
    if args.quick:
        measure(args.devices, quick=True)
        return
    asyncio.run(_measure(min(args.devices, 10), args.callers, args.seconds, args.repeats, args.stack))


if __name__ == "__main__":
    main()
