"""A real agent server in-process (uvicorn on 127.0.0.1) and a scripted AIP device over raw `websockets`.

The scripted device is deliberately not tether's device client: it sends exactly the frames a
test says, so the tests pin down the server's side of the protocol and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from pydantic import BaseModel
from starlette.applications import Starlette
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tests.kits import db as dbkit
from tether.device.link.trust.device_key import DeviceKey
from tether.protocol.codec import decode_server_message, encode
from tether.protocol.identity import CHALLENGE_HEADER
from tether.protocol.messages import (
    ClientMessage,
    ClientMessageType,
    Registration,
    ServerMessage,
    ServerMessageType,
    TaskStatus,
)
from tether.protocol.models import Command, Result, ResultStatus
from tether.protocol.profile import DeviceProfile
from tether.server.aip.hub import DeviceHub
from tether.server.aip.sockets.socket import aip_route
from tether.server.settings import ServerSettings
from tether.server.store import Store

WAIT = 5.0  # upper bound for anything that should happen "now"; never a sleep


def key_for(seed: str) -> DeviceKey:
    """The key a test device named `seed` proves, the same for every process of it: derived from the name
    (never do this outside tests), so two connections of one device need not share an object."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return DeviceKey(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"tether-test-key:{seed}".encode()).digest()))


def registration(ws: ClientConnection, name: str | None, instance_id: str, *, key: DeviceKey | None = None,
                 profile: DeviceProfile | None = None) -> Registration:
    """A REGISTER payload for a raw socket `ws`, proving `key` (default `key_for(name)`) for the challenge its
    upgrade carried."""
    challenge = ws.response.headers.get(CHALLENGE_HEADER) if ws.response is not None else None
    proof = (key or key_for(name or "")).register_proof(challenge, name, instance_id) if challenge else None
    return Registration(name=name, instance_id=instance_id, profile=profile or DeviceProfile(), proof=proof)


class Running:
    def __init__(self, hub: DeviceHub, store: Store, server: uvicorn.Server, task: asyncio.Task, port: int) -> None:
        self.hub, self.store, self.server, self.task, self.port = hub, store, server, task, port
        self.url = f"ws://127.0.0.1:{port}/aip"

    def token(self, name: str) -> str:
        return self.store.tokens.create("device", name)[1]

    def device(self, name: str, **kwargs: Any) -> FakeDevice:
        return FakeDevice(self.url, self.token(name), name=name, **kwargs)

    async def stop(self) -> None:
        await self.hub.aclose()
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 15)
        self.store.close()


@dbkit.keeps_server_state
class ServerFactory:
    """Starts servers with test settings (short timers where a test needs them) and stops them all."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.running: list[Running] = []

    async def start(self, ws_max_size: int = 1 << 20, **overrides: Any) -> Running:
        path = overrides.pop("db_path", self.tmp_path / f"server{len(self.running)}.db")
        values: dict[str, Any] = {**dbkit.settings_db(path),
                                  "heartbeat_interval": 5.0, "heartbeat_timeout": 30.0, "grace_period": 5.0,
                                  "register_timeout": 5.0, "max_frame_bytes": 4096}
        settings = ServerSettings(**{**values, **overrides})
        store = Store(dbkit.server_db(settings.db_path))
        hub = DeviceHub(store, settings)
        await hub.start()
        # bound and listening here: no race for a "free" port, and a client that connects before
        # uvicorn accepts waits in the backlog, so there is no "started" to wait for. IPPROTO_TCP so
        # asyncio sets TCP_NODELAY on accepted sockets (with proto 0 it does not).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        config = uvicorn.Config(Starlette(routes=[aip_route(hub)]), lifespan="off", log_config=None,
                                log_level="warning", ws_max_size=ws_max_size, ws_ping_interval=None)
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        running = Running(hub, store, server, task, port)
        self.running.append(running)
        return running

    async def stop_all(self) -> None:
        for running in self.running:
            await running.stop()


def ok(command: Command) -> Result:
    return Result(status=ResultStatus.SUCCESS, result={"tool": command.tool_name, "args": command.parameters},
                  call_id=command.call_id)


class FakeDevice:
    """One scripted device connection. Every wait is bounded by WAIT.

    It proves `key` at registration (by default `key_for` of its name, else of its token); `prove=False`
    sends a registration without a proof, as a device that holds only a token would."""

    def __init__(self, url: str, token: str | None, *, name: str | None = None, instance_id: str | None = None,
                 profile: DeviceProfile | None = None, key: DeviceKey | None = None, prove: bool = True) -> None:
        self.url, self.token, self.name = url, token, name
        self.instance_id = instance_id or uuid.uuid4().hex
        self.profile = profile or DeviceProfile()
        self.key = key or key_for(name or token or "")
        self.prove = prove
        self.challenge: str | None = None  # the one the server gave this connection
        self.ws: ClientConnection | None = None

    async def connect(self, authorization: str | None = None) -> None:
        header = authorization if authorization is not None else (f"Bearer {self.token}" if self.token else None)
        headers = {"Authorization": header} if header else {}
        self.ws = await connect(self.url, additional_headers=headers, ping_interval=None, max_size=None,
                                open_timeout=WAIT)
        self.challenge = self.ws.response.headers.get(CHALLENGE_HEADER)

    async def register(self, *, claim: str | None = "same", **frame: Any) -> ServerMessage:
        """Connect and send REGISTER; returns the server's answer (ack or refusal)."""
        if self.ws is None:
            await self.connect()
        claimed = self.name if claim == "same" else claim
        proof = (self.key.register_proof(self.challenge, claimed, self.instance_id)
                 if self.prove and self.challenge else None)
        reg = Registration(name=claimed, instance_id=self.instance_id, profile=self.profile, proof=proof)
        await self.send(ClientMessage(type=ClientMessageType.REGISTER, payload=reg.model_dump(), **frame))
        return await self.recv()

    async def send(self, message: BaseModel | str | bytes) -> None:
        assert self.ws is not None
        await self.ws.send(encode(message) if isinstance(message, BaseModel) else message)

    async def recv(self) -> ServerMessage:
        assert self.ws is not None
        return decode_server_message(await asyncio.wait_for(self.ws.recv(), WAIT), 1 << 30)

    async def expect(self, kind: ServerMessageType) -> ServerMessage:
        """The next frame of `kind`, skipping heartbeat replies."""
        while True:
            message = await self.recv()
            if message.type is kind:
                return message
            assert message.type is ServerMessageType.HEARTBEAT, f"expected {kind.value}, got {message}"

    async def close_code(self) -> tuple[int, str]:
        """Wait for the server to close the socket; returns its close code and reason."""
        assert self.ws is not None
        try:
            while True:
                await asyncio.wait_for(self.ws.recv(), WAIT)
        except ConnectionClosed as exc:
            assert exc.rcvd is not None, f"closed without a close frame: {exc}"
            return exc.rcvd.code, exc.rcvd.reason

    async def sync(self, running: int = 0) -> None:
        """A heartbeat round trip: once it returns, the server has handled every earlier frame."""
        await self.send(ClientMessage(type=ClientMessageType.HEARTBEAT, payload={"running": running}))
        await self.expect(ServerMessageType.HEARTBEAT)

    async def results(self, response_id: str, results: list[Result],
                      status: TaskStatus = TaskStatus.COMPLETED, **frame: Any) -> None:
        await self.send(ClientMessage(type=ClientMessageType.COMMAND_RESULTS, prev_response_id=response_id,
                                      action_results=results, status=status, **frame))

    async def answer_one(self, answer: Callable[[Command], Result] = ok) -> ServerMessage:
        command = await self.expect(ServerMessageType.COMMAND)
        await self.results(command.response_id, [answer(c) for c in command.actions or []])
        return command

    def serve_forever(self, answer: Callable[[Command], Result] = ok, keepalive: float = 2.0) -> asyncio.Task:
        """Answer every command until cancelled, as a live device does: no deadline on the next command
        (a test's CLI subprocess can take many seconds to send it on a loaded machine; a WAIT-bounded
        receive ended this loop then), and a heartbeat after each `keepalive` seconds without a frame,
        so the server never finds it silent past heartbeat_timeout however long the test takes (it went
        offline mid-batch under load). A frame other than a command or a heartbeat ends the loop, and so
        does the connection's end (the server stopping)."""
        async def loop() -> None:
            assert self.ws is not None
            while True:
                try:
                    frame = await asyncio.wait_for(self.ws.recv(), keepalive)
                except TimeoutError:
                    with contextlib.suppress(ConnectionClosed):
                        await self.send(ClientMessage(type=ClientMessageType.HEARTBEAT, payload={"running": 0}))
                    continue
                except ConnectionClosed:
                    return
                message = decode_server_message(frame, 1 << 30)
                if message.type is ServerMessageType.HEARTBEAT:
                    continue
                assert message.type is ServerMessageType.COMMAND, f"expected command, got {message}"
                await self.results(message.response_id, [answer(c) for c in message.actions or []])

        return asyncio.create_task(loop())

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()

    def abort(self) -> None:
        """Drop the TCP connection without a closing handshake, as a network failure would."""
        assert self.ws is not None
        self.ws.transport.abort()


async def logged(caplog: Any, text: str, timeout: float = WAIT) -> None:
    """Until `text` is in the captured log: what the server logs after a lookup made off its event loop (the
    audit worker with PostgreSQL) comes a moment after the frame that caused it. Woken by the record itself
    (a handler on the root logger, where caplog's records go too); bounded by `timeout`."""
    loop = asyncio.get_running_loop()
    heard = asyncio.Event()

    class _Hear(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                loop.call_soon_threadsafe(heard.set)

    handler = _Hear()
    logging.getLogger().addHandler(handler)
    try:
        if text not in caplog.text:
            async with asyncio.timeout(timeout):
                await heard.wait()
    finally:
        logging.getLogger().removeHandler(handler)
