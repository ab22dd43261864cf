"""The handle of one sandboxed command, and the pipes it is read and written through."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from tether.sandbox.runner.state import START_TIMEOUT_S

if TYPE_CHECKING:
    from tether.sandbox.runner.state import SandboxParts


class SandboxedProcess:
    """What `tether.tools.running.process` needs of a process: pid, pipes, wait() and kill()."""

    def __init__(self, sandbox: SandboxParts, request_id: int, pid: int, exited: asyncio.Future[int],
                 stdin: asyncio.StreamWriter | None, stdout: asyncio.StreamReader | None,
                 stderr: asyncio.StreamReader | None) -> None:
        self._sandbox, self._id, self.pid, self._exited = sandbox, request_id, pid, exited
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self.notes: list[str] = []  # what the sandbox has to say about this command's confinement
        self.cpu_s: float | None = None  # CPU seconds the command (and the children it waited for) used

    async def wait(self) -> int:
        self.returncode = await asyncio.shield(self._exited)
        self.notes = self._sandbox._notes.pop(self._id, [])
        self.notes += [r.describe() for r in self._sandbox._connections.pop(self._id, [])]
        self.cpu_s = self._sandbox._cpu.pop(self._id, None)
        return self.returncode

    def on_exit(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the process has exited (or its warden is gone)."""
        self._exited.add_done_callback(lambda _: callback())

    def kill(self) -> None:
        """SIGKILL the command's pid namespace: the command and everything it started."""
        if not self._exited.done():
            self._sandbox._send({"op": "kill", "id": self._id})

    async def terminate(self) -> None:
        self.kill()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(START_TIMEOUT_S):
                await self.wait()


def script_path(fd: int, path: str) -> str | None:
    """The real path of a `#!` script (read through the fd the device opened), None for a binary."""
    try:
        fd_read = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.readlink(f"/proc/self/fd/{fd}") if os.pread(fd_read, 2, 0) == b"#!" else None
    finally:
        os.close(fd_read)


async def pipe_reader(loop: asyncio.AbstractEventLoop, fd: int) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader


async def pipe_writer(loop: asyncio.AbstractEventLoop, fd: int) -> asyncio.StreamWriter:
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(fd, "wb", 0))
    return asyncio.StreamWriter(transport, protocol, None, loop)
