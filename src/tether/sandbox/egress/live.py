"""The egress proxy for a live process (a sandboxed stdio MCP server), which bwrap starts without the warden.

Such a process gets its own network namespace (`bwrap --unshare-net`) when the policy lists hosts, so
it has no direct network. To give it the same way out as a warden's command, the device passes one end
of a socketpair down to it (`child_fd`, see `bwrap.live_argv(egress_fd=...)`); the shim in front of the
program (`python -m tether.sandbox.confine.seccomp --egress-fd N`) opens a listening port on the namespace's
loopback, sends the listening socket back over it (SCM_RIGHTS) and points the program's proxy
variables at that port; the device then accepts from it with its one `EgressProxy` (the same rules,
audit and caps as every command). Standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

from tether.sandbox.egress.proxy import EgressProxy

logger = logging.getLogger(__name__)
HANDOVER_TIMEOUT_S = 30.0
MAX_MESSAGE = 64


class LiveEgress:
    """One live process's way to the egress proxy: make it and `listen()` before the process starts,
    `started()` once it has, `close()` when it has ended (the proxy stops accepting from its port)."""

    def __init__(self, proxy: EgressProxy, *, timeout_s: float = HANDOVER_TIMEOUT_S) -> None:
        self.proxy = proxy
        self.timeout_s = timeout_s
        self._ours, self._theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._ours.setblocking(False)
        self._waiter: asyncio.Task[None] | None = None
        self._served: asyncio.Task[None] | None = None
        self.port: int | None = None

    @property
    def child_fd(self) -> int:
        """The descriptor to pass down to the process (pass_fds) and name in its argv."""
        return self._theirs.fileno()

    def listen(self) -> None:
        """Wait for the process's port in the background and serve it once it arrives (call before the
        process starts: it sends the port at once)."""
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_task(self._receive())

    def started(self) -> None:
        """The process has its copy of the channel: drop ours."""
        with contextlib.suppress(OSError):
            self._theirs.close()

    async def _receive(self) -> None:
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(self._ours.fileno(), wake)
        try:
            async with asyncio.timeout(self.timeout_s):
                await readable
        except TimeoutError:
            logger.warning("a live process sent no egress port within %gs: it has no network", self.timeout_s)
            return
        finally:
            loop.remove_reader(self._ours.fileno())
        try:
            data, fds, _, _ = socket.recv_fds(self._ours, MAX_MESSAGE, 1)
        except OSError as exc:
            logger.warning("no egress port from a live process: %s", exc)
            return
        if len(fds) != 1 or not data.isdigit():
            for fd in fds:
                os.close(fd)
            return  # it ended before it opened one
        self.port = int(data)
        self._served = self.proxy.serve(socket.socket(fileno=fds[0]))

    def close(self) -> None:
        """Stop serving the process's port (its listener closes) and drop the channel."""
        for task in (self._waiter, self._served):
            if task is not None:
                task.cancel()
        for sock in (self._ours, self._theirs):
            with contextlib.suppress(OSError):
                sock.close()
