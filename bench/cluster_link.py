"""A cluster link's own cost: CPU per round trip over a real link between two nodes' `Links`, against a bare
WebSocket echo on the same stack.

    python -m bench.cluster_link [--base SRC] [--rounds 10] [--trips 2000]

Both ends run in this process on one event loop (uvloop, as `tether server` runs): a uvicorn server (the
websockets-sansio protocol, no compression, as the nodes serve) whose `/cluster/link` route is one `Links`'
`accept`, and a second `Links` that dials it with the real proof of a shared secret. Each trip sends one
request-sized message (`{"t": "req", …}` with a 250-character command) from the dialling end and waits for
the accepting end's `done`, sent the moment its dispatch sees the request — a crossing's link frames and
nothing else (no bus, no hub, no device). The process's CPU per trip (both ends, and the kernel's socket
work) is what is measured.

The **anchor** is the floor for a WebSocket link on this stack: a websockets client whose frames a raw-ASGI
endpoint on the same uvicorn answers at once. Beside it, **tcp**: the same frames length-prefixed over a plain
TCP connection, answered in the protocol callback — the floor under any link transport (the kernel's socket
work and the loop's wake-ups), i.e. what a transport below WebSocket could at best come down to.

With `--base SRC` (another checkout's `src`) that tree's `tether/server/cluster/link.py` is loaded alongside
and measured too. Rounds rotate their order; printed: medians over the rounds, their spread, and the ratios
to the anchor (and this tree/base), with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from bench._stats import spread
from bench.kit.ports import free_port

BODY = {"device": "d", "from": "b", "message": "x" * 250, "asker": None}
PATH = "/cluster/link"
Trip = Callable[[int], Awaitable[None]]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _serve(app: Any, port: int) -> Callable[[], Awaitable[None]]:
    """uvicorn serving `app` on `port` as the nodes do; returns its stop."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                           ws="websockets-sansio", ws_per_message_deflate=False,
                                           ws_ping_interval=None))
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.01)  # uvicorn says it started by a flag only

    async def stop() -> None:
        server.should_exit = True
        await task

    return stop


async def link_pair(link: ModuleType) -> tuple[Trip, Callable[[], Awaitable[None]]]:
    """Two `Links` of module `link` linked over a real socket; a trip function and their stop."""
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute

    port = free_port()
    answered: dict[str, asyncio.Future[dict[str, Any]]] = {}
    tasks: set[asyncio.Task[None]] = set()

    async def secret() -> str:
        return "s" * 64

    async def lookup(peer: str) -> str:
        return f"ws://127.0.0.1:{port}{PATH}"

    def answer(message: dict[str, Any]) -> None:  # the accepting end: a done for each request, at once
        task = asyncio.create_task(accepting._links["b"].send(
            {"t": "done", "rid": message["rid"], "body": {"results": "[]"}}))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def heard(message: dict[str, Any]) -> None:
        waiter = answered.pop(str(message.get("rid")), None)
        if waiter is not None:
            waiter.set_result(message)

    def nothing(*_: Any) -> None:
        return None

    accepting = link.Links("a", answer, nothing, lookup, secret, max_frame=1 << 24, elsewhere=nothing)
    dialling = link.Links("b", heard, nothing, lookup, secret, max_frame=1 << 24, elsewhere=nothing)
    stop_server = await _serve(Starlette(routes=[WebSocketRoute(PATH, accepting.accept)]), port)
    dialling.get("a")
    async with asyncio.timeout(10):
        while "a" not in dialling._links or "b" not in accepting._links:
            await asyncio.sleep(0.01)  # the dial runs in its own task; no event says it is done

    async def trip(i: int) -> None:
        waiter = answered[str(i)] = asyncio.get_running_loop().create_future()
        await dialling._links["a"].send({"t": "req", "rid": str(i), "from": "b", "kind": "batch", "body": BODY})
        await waiter

    async def stop() -> None:
        await dialling.aclose()
        await accepting.aclose()
        await stop_server()

    return trip, stop


async def echo_pair() -> tuple[Trip, Callable[[], Awaitable[None]]]:
    """The anchor: a websockets client and a raw-ASGI echo endpoint on the same uvicorn, the same frames."""
    import websockets
    from pydantic_core import from_json, to_json

    port = free_port()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        while (message := await receive())["type"] == "websocket.receive":
            request = from_json(message["text"])[0]
            reply = [{"t": "done", "rid": request["rid"], "body": {"results": "[]"}}]
            await send({"type": "websocket.send", "text": to_json(reply).decode()})

    stop_server = await _serve(app, port)
    connection = await websockets.connect(f"ws://127.0.0.1:{port}{PATH}", compression=None, ping_interval=None)

    async def trip(i: int) -> None:
        await connection.send(to_json([{"t": "req", "rid": str(i), "from": "b", "kind": "batch",
                                        "body": BODY}]).decode())
        from_json(await connection.recv())

    async def stop() -> None:
        await connection.close()
        await stop_server()

    return trip, stop


async def tcp_pair() -> tuple[Trip, Callable[[], Awaitable[None]]]:
    """The floor under any link: the same frames, length-prefixed over a plain TCP connection, each handled in
    its protocol's `data_received` (no WebSocket, no task per frame)."""
    from pydantic_core import from_json, to_json

    def frames(buffer: bytearray) -> list[bytes]:
        out = []
        while len(buffer) >= 4 and len(buffer) >= 4 + (size := int.from_bytes(buffer[:4], "big")):
            out.append(bytes(buffer[4:4 + size]))
            del buffer[:4 + size]
        return out

    def framed(data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + data

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.buffer = bytearray()

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            for frame in frames(self.buffer):
                request = from_json(frame)[0]
                reply = [{"t": "done", "rid": request["rid"], "body": {"results": "[]"}}]
                self.transport.write(framed(to_json(reply)))  # type: ignore[attr-defined]

    class Client(asyncio.Protocol):
        def __init__(self) -> None:
            self.buffer = bytearray()
            self.waiter: asyncio.Future[Any] | None = None

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            for frame in frames(self.buffer):
                if self.waiter is not None and not self.waiter.done():
                    self.waiter.set_result(from_json(frame))

    loop = asyncio.get_running_loop()
    port = free_port()
    server = await loop.create_server(Echo, "127.0.0.1", port)
    transport, client = await loop.create_connection(Client, "127.0.0.1", port)

    async def trip(i: int) -> None:
        client.waiter = loop.create_future()
        transport.write(framed(to_json([{"t": "req", "rid": str(i), "from": "b", "kind": "batch", "body": BODY}])))
        await client.waiter

    async def stop() -> None:
        transport.close()
        server.close()
        await server.wait_closed()

    return trip, stop


async def _cpu_per_trip(trip: Trip, n: int) -> float:
    start = time.process_time()
    for i in range(n):
        await trip(i)
    return (time.process_time() - start) / n


async def measure(base: Path | None, rounds: int, trips: int) -> dict[str, list[float]]:
    pairs: dict[str, tuple[Trip, Callable[[], Awaitable[None]]]] = {"anchor": await echo_pair(),
                                                                    "tcp": await tcp_pair()}
    pairs["link"] = await link_pair(_load("bench_link_this", Path(__file__).resolve().parents[1] / "src" / "tether"
                                          / "server" / "cluster" / "link.py"))
    if base is not None:
        pairs["base"] = await link_pair(_load("bench_link_base", base / "tether" / "server" / "cluster" / "link.py"))
    per: dict[str, list[float]] = {name: [] for name in pairs}
    try:
        for trip, _ in pairs.values():
            await _cpu_per_trip(trip, 300)  # warm
        for r in range(rounds):
            order = list(pairs)[r % len(pairs):] + list(pairs)[:r % len(pairs)]
            for name in order:
                per[name].append(await _cpu_per_trip(pairs[name][0], trips))
    finally:
        for _, stop in pairs.values():
            await stop()
    return per


def report(per: dict[str, list[float]]) -> None:
    print(f"-- {os.cpu_count()} cores, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for name, values in per.items():
        us = [v * 1e6 for v in values]
        print(f"{name:>6}: CPU per round trip {statistics.median(us):.1f} us ({spread(us)})")
    for name in ("link", "base", "tcp"):
        if name in per:
            ratios = [a / b for a, b in zip(per[name], per["anchor"], strict=True)]
            print(f"{name} / anchor: {statistics.median(ratios):.2f}x ({spread(ratios)})")
    if "base" in per:
        ratios = [a / b for a, b in zip(per["link"], per["base"], strict=True)]
        print(f"this tree / base: {statistics.median(ratios):.3f}x ({spread(ratios)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, metavar="SRC", help="another checkout's src, measured alongside")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--trips", type=int, default=2000, help="round trips per round and pair")
    args = parser.parse_args()
    if args.rounds < 1 or args.trips < 1:
        sys.exit("--rounds and --trips must be at least 1")
    if args.base is not None and not (args.base / "tether" / "server" / "cluster" / "link.py").is_file():
        sys.exit("--base must be a src holding tether/server/cluster/link.py")
    import uvloop

    report(uvloop.run(measure(args.base, args.rounds, args.trips)))


if __name__ == "__main__":
    main()
