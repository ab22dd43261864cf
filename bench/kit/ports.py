"""A TCP port on 127.0.0.1 for a process about to be started (a `tether server`, redis-server, PostgreSQL),
which must be told its port before it binds it.

The usual trick (bind port 0, read the number, close, hand it over) races: until the child binds it, the
port is free, and the kernel may give the same number to anyone else's `bind(0)` or outgoing connection.
The suite runs in several processes at once (pytest-xdist workers, and on a developer's machine other
test runs), each binding and connecting all the time, so that window is hit.

Instead the ports come from below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), where
neither `bind(0)` nor `connect()` ever picks one, and each process walks that range from its own random
start, so two processes would have to step on the same number in the same moment to meet. A candidate is
bound once to check that nothing (another service, a server still shutting down) holds it. Where the
ephemeral range leaves no room below it, this falls back to `bind(0)`.
"""

from __future__ import annotations

import functools
import itertools
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

LOWEST = 10000  # below: well-known services
MIN_SPAN = 2000  # fewer ports than this below the ephemeral range: use bind(0)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _walk() -> Iterator[int] | None:
    high = _ephemeral_low()
    if high - LOWEST < MIN_SPAN:
        return None
    span = high - LOWEST
    start = random.SystemRandom().randrange(span)
    return (LOWEST + (start + step) % span for step in itertools.count())


class _Walk:
    """This process's cursor over the range (None: no room below the ephemeral range); the lock makes it
    safe from several threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cursor = _walk()


@functools.cache
def _this_process() -> _Walk:
    return _Walk()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and that no other process of the suite is
    handed at the same time (see the module's docstring). Raises OSError if none is free."""
    walk = _this_process()
    if walk.cursor is not None:
        with walk.lock:
            for port in itertools.islice(walk.cursor, 512):
                if _bindable(port):
                    return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
