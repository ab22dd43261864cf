"""A stdio transport for MCP sessions that bounds the size of what a server may send.

The SDK's `stdio_client` joins a long line chunk by chunk (`(buffer + chunk).split("\\n")`), which is
quadratic: a 50 MB answer kept a device's event loop busy for 16-100 s, every other tool stalled
behind it, and a call that timed out meanwhile left the next call waiting for the rest. This
transport does what `stdio_client` does (same process group, same spec shutdown: close stdin,
wait, then kill the tree) with a linear line reader that holds at most `max_message_bytes` of a line:
a longer one is discarded as it streams in, and the request it answers gets a JSON-RPC error
(`TOO_LARGE`, data `{"too_large": true, "bytes": …, "limit": …}`) at once, so the call fails
quickly and clearly while the session stays usable.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
from collections.abc import AsyncIterator
from typing import Any, TextIO

import anyio
import anyio.lowlevel
import mcp_types
from anyio.abc import Process
from mcp.client.stdio import StdioServerParameters, get_default_environment, stdio_client
from mcp.os.posix.utilities import terminate_posix_process_tree
from mcp.shared.message import SessionMessage

logger = logging.getLogger(__name__)

TOO_LARGE = -32050  # an implementation-defined JSON-RPC server error: the message was over the size cap
READ_CHUNK = 1 << 20
_STOP_GRACE = 2.0  # the SDK's PROCESS_TERMINATION_TIMEOUT: time to exit after stdin closes
_KILL_GRACE = 2.0
_FLUSH_GRACE = 0.5
_EDGE = 512  # bytes of an oversized line kept at each end, to find the id of the request it answers

_ID = rb'(-?\d+|"(?:[^"\\]|\\.)*")'
_HEAD_ID = re.compile(rb'\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"id"\s*:\s*' + _ID)
_HEAD_IS_REQUEST = re.compile(rb'\s*,\s*"method"')
_TAIL_ID = re.compile(rb'"id"\s*:\s*' + _ID + rb'\s*(?:,\s*"jsonrpc"\s*:\s*"2\.0"\s*)?\}\s*$')


def _head_id(head: bytes) -> int | str | None:
    """The id of a response whose first bytes are `head` (the Python SDK writes jsonrpc, id, result)."""
    match = _HEAD_ID.match(head)
    if match is None or _HEAD_IS_REQUEST.match(head, match.end()):  # a request of the server's own
        return None
    return json.loads(match.group(1))


def _tail_id(tail: bytes) -> int | str | None:
    """The id of a response whose last bytes are `tail` (the TypeScript SDK writes result, jsonrpc, id)."""
    match = _TAIL_ID.search(tail)
    return json.loads(match.group(1)) if match else None


class LineSplitter:
    """Newline-delimited messages out of a byte stream, in linear time and bounded memory.

    `feed` returns complete lines (bytes) and, for a line over `limit` bytes, one `Oversized` note:
    as soon as the line passes the limit when its request id is at its start, else when it ends."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()
        self._scanned = 0  # _buf[:_scanned] holds no newline
        self._skipping = False
        self._skipped = 0
        self._head = b""
        self._tail = bytearray()
        self._answered = False

    def feed(self, chunk: bytes) -> list[bytes | Oversized]:
        out: list[bytes | Oversized] = []
        while chunk:
            if self._skipping:
                end = chunk.find(b"\n")
                part = chunk if end < 0 else chunk[:end]
                self._skipped += len(part)
                self._tail += part[-_EDGE:]
                del self._tail[:-_EDGE]
                if end < 0:
                    return out
                self._end_skip(out)
                chunk = chunk[end + 1:]
                continue
            self._buf += chunk
            chunk = b""
            while True:
                end = self._buf.find(b"\n", self._scanned)
                if end < 0:
                    self._scanned = len(self._buf)
                    break
                line = bytes(self._buf[:end])
                del self._buf[:end + 1]
                self._scanned = 0
                if len(line) > self.limit:
                    self._begin_skip(line[:_EDGE], len(line), out)
                    self._tail = bytearray(line[-_EDGE:])
                    self._end_skip(out)
                else:
                    out.append(line)
            if len(self._buf) > self.limit:  # a line too long to hold: drop it as it streams in
                rest = bytes(self._buf)
                self._buf.clear()
                self._scanned = 0
                self._skipping = True
                self._begin_skip(rest[:_EDGE], len(rest), out)
                self._tail = bytearray(rest[-_EDGE:])
        return out

    def _begin_skip(self, head: bytes, size: int, out: list[bytes | Oversized]) -> None:
        self._head, self._skipped, self._answered = head, size, False
        request_id = _head_id(head)
        if request_id is not None:
            out.append(Oversized(request_id, size, done=False))
            self._answered = True

    def _end_skip(self, out: list[bytes | Oversized]) -> None:
        self._skipping = False
        if self._answered:
            out.append(Oversized(None, self._skipped, done=True))
        else:
            out.append(Oversized(_tail_id(bytes(self._tail)), self._skipped, done=True))
        self._tail = bytearray()


class Oversized:
    """A message over the limit: `request_id` (when known and not yet answered) and its size so far."""

    __slots__ = ("done", "request_id", "size")

    def __init__(self, request_id: int | str | None, size: int, *, done: bool) -> None:
        self.request_id = request_id
        self.size = size
        self.done = done


def too_large_error(request_id: int | str, size: int, limit: int, *, done: bool) -> SessionMessage:
    """The JSON-RPC error the session receives instead of a response that was too large."""
    bytes_text = f"{size} bytes" if done else f"more than {limit} bytes"
    message = (f"result too large: the server sent {bytes_text}, over this device's limit of {limit} bytes "
               f"for one MCP message (set by max_result_bytes); ask for less (a narrower query, a page, a file "
               f"to read in parts)")
    error = mcp_types.jsonrpc_message_adapter.validate_python({
        "jsonrpc": "2.0", "id": request_id,
        "error": {"code": TOO_LARGE, "message": message,
                  "data": {"too_large": True, "bytes": size, "limit": limit, "complete": done}}})
    return SessionMessage(error)


def _parse(line: bytes) -> SessionMessage | Exception:
    try:
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        logger.warning("an MCP server sent a line that is not a JSON-RPC message: %s", exc)
        return exc


@contextlib.asynccontextmanager
async def bounded_stdio_client(server: StdioServerParameters, errlog: TextIO, max_message_bytes: int,
                               pass_fds: tuple[int, ...] = ()) -> AsyncIterator[tuple[Any, Any]]:
    """`mcp.client.stdio.stdio_client` with a cap on each message the server sends (POSIX; elsewhere
    the SDK's own transport, uncapped); `pass_fds` stay open in the server's process."""
    if sys.platform == "win32":  # pragma: no cover - the SDK's Job Object handling is Windows' own
        async with stdio_client(server, errlog=errlog) as streams:
            yield streams
        return
    process = await anyio.open_process([server.command, *server.args],
                                       env=get_default_environment() | (server.env or {}), stderr=errlog,
                                       cwd=server.cwd, start_new_session=True, pass_fds=pass_fds)
    to_session, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, from_session = anyio.create_memory_object_stream[SessionMessage](0)
    writer_done = anyio.Event()
    closing = False

    async def read_stdout() -> None:
        assert process.stdout is not None
        splitter = LineSplitter(max_message_bytes)
        try:
            async with to_session:
                while True:
                    try:
                        chunk = await process.stdout.receive(READ_CHUNK)
                    except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                        return
                    for item in splitter.feed(chunk):
                        if isinstance(item, Oversized):
                            if item.done:
                                logger.warning("MCP server %s sent a message of %d bytes (limit %d): dropped",
                                               server.command, item.size, max_message_bytes)
                            if item.request_id is None:
                                continue
                            message: SessionMessage | Exception = too_large_error(
                                item.request_id, item.size, max_message_bytes, done=item.done)
                        else:
                            message = _parse(item)
                        try:
                            await to_session.send(message)
                        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                            return
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                while True:  # keep a server that is still writing from blocking on a full pipe
                    await process.stdout.receive(READ_CHUNK)

    async def write_stdin() -> None:
        assert process.stdin is not None
        try:
            async with from_session:
                async for message in from_session:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                    await process.stdin.send(data.encode())
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            if not closing:
                await to_session.aclose()
        finally:
            writer_done.set()

    async def stop() -> None:
        read_stream.close()
        write_stream.close()
        with anyio.move_on_after(_FLUSH_GRACE):
            await writer_done.wait()
        await _stop_process(process)
        for stream in (read_stream, write_stream, to_session, from_session):
            await stream.aclose()
        await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(read_stdout)
        tg.start_soon(write_stdin)
        try:
            yield read_stream, write_stream
        finally:
            closing = True
            with anyio.CancelScope(shield=True):
                await stop()
            tg.cancel_scope.cancel()


async def _stop_process(process: Process) -> None:
    """The MCP shutdown sequence: close stdin, let it exit, then end its whole process group."""
    assert process.stdin is not None and process.stdout is not None
    with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
        await process.stdin.aclose()
    if not await _exited(process, _STOP_GRACE):
        await terminate_posix_process_tree(process, _KILL_GRACE)
        if not await _exited(process, _KILL_GRACE):
            logger.warning("MCP server process %d survived the kill; abandoning it", process.pid)
    with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
        await process.stdout.aclose()
    transport = getattr(getattr(process, "_process", None), "_transport", None)
    with contextlib.suppress(Exception):
        transport.close()  # type: ignore[union-attr]


async def _exited(process: Process, timeout: float) -> bool:
    """Poll returncode (not `wait()`, which also waits for pipe EOF that a grandchild may hold open)."""
    with anyio.move_on_after(timeout):
        while process.returncode is None:  # noqa: ASYNC110 - no event tells us; the SDK polls the same way
            await anyio.sleep(0.01)
    return process.returncode is not None
