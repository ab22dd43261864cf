"""One write per response sent whole (server/http/coalesce.py) and when a batch's headers go
(routes.commands.BatchResponse).

- `CoalescingTransport` over a real socket pair: the writes of one loop turn reach the peer as one
  write, in order; `close` sends what is pending first, `abort` drops it; the WebSocket upgrade's
  `set_protocol` flushes before the new protocol takes over, and hands it the real transport.
- The whole app under uvicorn with the coalescing protocol and a scripted device: a batch that ends at
  once is answered with `Content-Length` (not chunked); one the device holds gets its headers, with
  `X-Tether-Batch`, while it still runs — the caller can cancel it by that id — and the results after.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn

from tests.kits.aip import WAIT, FakeDevice
from tether.protocol.messages import ServerMessageType
from tether.server.http.app import create_app
from tether.server.http.coalesce import CoalescingTransport, coalescing_http_protocol
from tether.server.settings import ServerSettings
from tether.server.store import Store


class Counting(asyncio.Protocol):
    """The writing end's protocol: the real transport is what the wrapper writes through."""


async def socket_pair() -> tuple[asyncio.Transport, asyncio.StreamReader, asyncio.StreamWriter]:
    """Our transport and the peer's reader (and writer: a StreamWriter closes its socket when collected)."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, _ = await loop.connect_accepted_socket(Counting, ours)
    reader, writer = await asyncio.open_connection(sock=theirs)
    return transport, reader, writer


class WriteLog:
    """Wraps a real transport's `write` to count the calls that reach it."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.calls: list[bytes] = []
        real = transport.write

        def write(data: bytes) -> None:
            self.calls.append(bytes(data))
            real(data)

        transport.write = write  # type: ignore[method-assign]


async def test_the_writes_of_one_turn_reach_the_peer_as_one_write_in_order():
    transport, reader, _peer = await socket_pair()
    log = WriteLog(transport)
    wrapped = CoalescingTransport(transport, asyncio.get_running_loop())
    wrapped.write(b"HTTP/1.1 200 OK\r\n")
    wrapped.write(b"")
    wrapped.writelines([b"content-length: 2\r\n\r\n", memoryview(b"{}")])
    assert log.calls == []  # nothing yet: at the end of the turn
    assert await asyncio.wait_for(reader.readexactly(40), WAIT) == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
    assert log.calls == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    wrapped.write(b"next")  # a later turn: a write of its own
    assert await asyncio.wait_for(reader.readexactly(4), WAIT) == b"next"
    assert len(log.calls) == 2
    wrapped.close()


async def test_close_sends_what_is_pending_first_and_abort_drops_it():
    transport, reader, _peer = await socket_pair()
    wrapped = CoalescingTransport(transport, asyncio.get_running_loop())
    wrapped.write(b"last words")
    wrapped.close()
    assert await asyncio.wait_for(reader.read(), WAIT) == b"last words"  # then EOF

    transport, reader, _peer = await socket_pair()
    wrapped = CoalescingTransport(transport, asyncio.get_running_loop())
    wrapped.write(b"never sent")
    wrapped.abort()
    assert await asyncio.wait_for(reader.read(), WAIT) == b""
    assert wrapped.is_closing()


async def test_set_protocol_flushes_before_the_new_protocol_takes_over():
    transport, reader, _peer = await socket_pair()
    log = WriteLog(transport)
    wrapped = CoalescingTransport(transport, asyncio.get_running_loop())
    wrapped.write(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")
    wrapped.set_protocol(Counting())
    assert log.calls == [b"HTTP/1.1 101 Switching Protocols\r\n\r\n"]  # already written, not at the turn's end
    assert await asyncio.wait_for(reader.readexactly(36), WAIT) == b"HTTP/1.1 101 Switching Protocols\r\n\r\n"
    wrapped.close()


async def test_the_websocket_protocol_is_handed_the_real_transport_at_the_upgrade():
    """uvicorn's WebSocket protocol got the wrapper in `connection_made`; after `set_protocol` its frames
    go straight to the socket (nothing to join there), in order after what was pending."""
    transport, reader, _peer = await socket_pair()
    log = WriteLog(transport)
    wrapped = CoalescingTransport(transport, asyncio.get_running_loop())
    upgraded = Counting()
    upgraded.transport = wrapped  # as uvicorn's WebSocketsSansIOProtocol.connection_made keeps it
    wrapped.write(b"pending")
    wrapped.set_protocol(upgraded)
    assert upgraded.transport is transport
    upgraded.transport.write(b"frame")
    assert log.calls == [b"pending", b"frame"]
    assert await asyncio.wait_for(reader.readexactly(12), WAIT) == b"pendingframe"
    transport.close()


# -- the app under uvicorn with the coalescing protocol ----------------------------------------------


class Running:
    def __init__(self, store: Store, port: int) -> None:
        self.store, self.port = store, port
        self.api = store.tokens.create("api", "runner", ["execute"])[1]

    async def request(self, method: str, path: str,
                      body: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {self.api}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        return reader, writer


async def read_head(reader: asyncio.StreamReader) -> dict[str, str]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 200"), lines[0]
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}


@pytest.fixture(params=["coalescing", "plain"])
async def running(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Running]:
    """The app under uvicorn with tether's HTTP protocol, and (`plain`) with uvicorn's own, as under
    another ASGI server: what the protocol adds (one write, the disconnect hook) has a fallback."""
    db = tmp_path / "server.db"
    store = Store(db)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    http = coalescing_http_protocol() if request.param == "coalescing" else "auto"
    server = uvicorn.Server(uvicorn.Config(create_app(ServerSettings(db_path=db), store), lifespan="on",
                                           log_config=None, log_level="warning", ws_ping_interval=None,
                                           http=http))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    yield Running(store, sock.getsockname()[1])
    server.should_exit = True
    await asyncio.wait_for(task, 15)


BODY = json.dumps({"commands": [{"tool_name": "noop", "parameters": {}}]}).encode()


async def test_a_quick_batch_is_answered_whole_with_content_length(running: Running,
                                                                  monkeypatch: pytest.MonkeyPatch):
    # "quick" is "done before its headers are due" (HEADERS_AFTER_S), which a loaded machine (parallel test workers
    # on 2 cores) missed: due only after WAIT here, the batch is quick by construction, not by timing
    from tether.server.http.routes import commands

    monkeypatch.setattr(commands, "HEADERS_AFTER_S", WAIT)
    device = FakeDevice(f"ws://127.0.0.1:{running.port}/aip", running.store.tokens.create("device", "alpha")[1],
                        name="alpha")
    await device.register()
    serving = device.serve_forever()
    reader, writer = await running.request("POST", "/api/v1/devices/alpha/commands", BODY)
    headers = await read_head(reader)
    assert "transfer-encoding" not in headers and headers["x-tether-batch"]
    body = json.loads(await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), WAIT))
    assert body["device"] == "alpha" and body["results"][0]["status"] == "success"
    writer.close()
    serving.cancel()
    await device.close()


async def test_a_held_batch_gets_its_headers_first_and_can_be_cancelled_by_their_id(running: Running):
    device = FakeDevice(f"ws://127.0.0.1:{running.port}/aip", running.store.tokens.create("device", "alpha")[1],
                        name="alpha")
    await device.register()
    reader, writer = await running.request("POST", "/api/v1/devices/alpha/commands", BODY)
    held = await device.expect(ServerMessageType.COMMAND)  # the device holds it: no answer yet
    headers = await read_head(reader)  # ...and the caller already has the headers
    assert headers["transfer-encoding"] == "chunked" and headers["x-tether-batch"] == held.response_id
    _, cancel_writer = await running.request("DELETE", f"/api/v1/batches/{headers['x-tether-batch']}")
    cancel = await device.expect(ServerMessageType.CANCEL)
    assert cancel.response_id == held.response_id
    size = int(await asyncio.wait_for(reader.readline(), WAIT), 16)
    body = json.loads(await asyncio.wait_for(reader.readexactly(size), WAIT))
    assert body["results"][0]["status"] == "failure" and "cancel" in body["results"][0]["error"]
    for w in (writer, cancel_writer):
        w.close()
    await device.close()


async def test_a_caller_that_disconnects_cancels_its_batch_on_the_device(running: Running):
    """The caller of a held batch goes away: the device gets a CANCEL saying so and the audit row records
    it — told by the protocol's disconnect hook (coalescing) or by the fallback task reading `receive`."""
    device = FakeDevice(f"ws://127.0.0.1:{running.port}/aip", running.store.tokens.create("device", "alpha")[1],
                        name="alpha")
    await device.register()
    reader, writer = await running.request("POST", "/api/v1/devices/alpha/commands", BODY)
    held = await device.expect(ServerMessageType.COMMAND)
    await read_head(reader)
    writer.close()
    cancel = await device.expect(ServerMessageType.CANCEL)
    assert cancel.response_id == held.response_id
    # the server wrote the outcome in the same step that sent the CANCEL (one loop, no await between)
    [row] = running.store.audit.rows(device="alpha")
    assert row["status"] == "failure" and "disconnected" in row["error"], row
    await device.close()


async def test_the_disconnect_hook_fires_at_once_for_a_connection_already_lost():
    """`ON_DISCONNECT` asked after the connection is gone: the callback still runs (on the next turn)."""
    protocol_class = coalescing_http_protocol()
    transport, _reader, _peer = await socket_pair()
    fired = asyncio.Event()

    class App:
        async def __call__(self, scope, receive, send):  # never reached: no request is parsed
            raise AssertionError

    config = uvicorn.Config(App(), log_config=None)
    config.load()
    from uvicorn.server import ServerState
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(transport)
    protocol.connection_lost(None)
    unwatch = protocol._watch(fired.set)
    await asyncio.wait_for(fired.wait(), WAIT)
    unwatch()
