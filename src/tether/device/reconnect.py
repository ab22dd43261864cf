"""The reconnection policy of `DeviceConnection`: which failures end `run()`, how long to wait, what to say.

A device reconnects forever, so every failed attempt asks the same three questions: is this a
refusal retrying cannot fix (bad token, name mismatch) or one worth another try (a duplicate that
may be this device's own dead link, a network error)? How long to wait, so that a fleet does not
reconnect in lockstep after a server restart? And how does the failure read in the log and in
`last_error`? The answers are policy, not socket handling, so they live here where they can be
read and tested without a server.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from tether.protocol.codec import FrameError

FATAL_CLOSE_CODES = {4400: "bad registration or protocol version", 4401: "unauthorized",
                     4403: "name does not match the token"}
DUPLICATE_CLOSE_CODE = 4409
RETRYABLE = (OSError, InvalidHandshake, ConnectionClosed, TimeoutError, ConnectionError, FrameError)


class RegistrationRefused(Exception):
    """The server refused this device; `fatal` refusals end `run()`, the others are retried."""

    def __init__(self, error: str, code: int | None = None) -> None:
        self.error = error
        self.code = code
        self.fatal = code in FATAL_CLOSE_CODES or code in (401, 403)
        what = FATAL_CLOSE_CODES.get(code or 0) or ("duplicate device" if code == DUPLICATE_CLOSE_CODE else None)
        super().__init__(f"registration refused ({code}{': ' + what if what else ''}): {error}"
                         if code is not None else f"registration refused: {error}")


class RetriesExhausted(ConnectionError):
    """`max_attempts` connection attempts in a row failed."""


def backoff_delay(attempt: int, base: float = 0.5, cap: float = 30.0,
                  rand: Callable[[], float] = random.random) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**attempt)]."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    return rand() * min(cap, base * 2.0 ** min(attempt, 64))


def describe_failure(exc: BaseException) -> str:
    """A failed attempt in a few words, for the log and `last_error`."""
    if isinstance(exc, InvalidStatus):
        return f"the server answered HTTP {exc.response.status_code} instead of a WebSocket"
    if isinstance(exc, ConnectionClosed):
        frame = exc.rcvd
        return (f"connection closed ({frame.code}{': ' + frame.reason if frame.reason else ''})"
                if frame else "connection lost")
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
