"""An ASGI app served by uvicorn in this process on a loopback port, as the task benchmarks run the agent
server (bench/server_tasks.py, bench/graph_tasks.py, bench/task_follow.py)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any


async def serve(app: Any) -> tuple[int, Callable[[], Awaitable[None]]]:
    """Start serving `app` (its lifespan on, no per-message deflate, no pings) on 127.0.0.1; its port, and the
    coroutine function that stops it (and awaits its lifespan's shutdown). The socket is made with its protocol
    named, so asyncio sets TCP_NODELAY on the accepted connections (bench/roundtrip.py)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_config=None, log_level="warning",
                                           ws_per_message_deflate=False, ws_ping_interval=None))
    serving = asyncio.create_task(server.serve(sockets=[sock]))

    async def stop() -> None:
        server.should_exit = True
        await serving

    return sock.getsockname()[1], stop
