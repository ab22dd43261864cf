"""The reconnection policy of `DeviceConnection`: which failures end `run()`, how long to wait, what to say.

A device reconnects forever, so every failed attempt asks the same three questions: is this a
refusal retrying cannot fix (bad token, name mismatch) or one worth another try (a duplicate that
may be this device's own dead link, a network error)? How long to wait, so that a fleet does not
reconnect in lockstep after a server restart? And how does the failure read in the log and in
`last_error`? The answers are policy, not socket handling, so they live here where they can be
read and tested without a server.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from tether.errors import DeviceError
from tether.protocol.codec import FrameError
from tether.protocol.wire import CloseCode

PIN_MISMATCH = 495  # nginx's "SSL Certificate Error": the device itself refuses to go on
FATAL_CLOSE_CODES: dict[int, str] = {CloseCode.BAD_REGISTRATION: "bad registration or protocol version",
                                     CloseCode.UNAUTHORIZED: "unauthorized",
                                     CloseCode.KEY_REFUSED: "the device's key is not the one enrolled for it",
                                     CloseCode.WRONG_DEVICE: "name does not match the token",
                                     PIN_MISMATCH: "the server's TLS certificate is not the pinned one"}
RETRYABLE = (OSError, InvalidHandshake, ConnectionClosed, TimeoutError, ConnectionError, FrameError)


class RegistrationRefused(DeviceError):
    """The server refused this device; `fatal` refusals end `run()`, the others are retried."""

    def __init__(self, error: str, code: int | None = None) -> None:
        self.error = error
        self.code = code
        self.fatal = code in FATAL_CLOSE_CODES or code in (401, 403)
        what = FATAL_CLOSE_CODES.get(code or 0) or ("duplicate device" if code == CloseCode.DUPLICATE else None)
        super().__init__(f"registration refused ({code}{': ' + what if what else ''}): {error}"
                         if code is not None else f"registration refused: {error}")


class RetriesExhausted(DeviceError, ConnectionError):
    """`max_attempts` connection attempts in a row failed."""


# While the server keeps this device's batches for it (its grace period), no wait between attempts
# is longer than this share of the grace left, nor shorter than GRACE_FLOOR_S: the attempts grow
# denser as the window closes, so a server that becomes reachable again is found well inside it.
GRACE_SHARE = 0.25
GRACE_FLOOR_S = 0.05


# The first attempt after a connection that was up ends is spread over this many seconds (full jitter):
# after a server restart the whole fleet lost its link in the same instant, and a spread of 0.5 s (the
# plain first backoff) sends 10,000 handshakes at 20,000/s into a server still starting.
RESTART_SPREAD_S = 2.0
RETRY_AFTER_MAX_S = 60.0


def backoff_delay(attempt: int, base: float = 0.5, cap: float = 30.0,
                  rand: Callable[[], float] = random.random, *, grace_left: float | None = None,
                  grace_share: float = GRACE_SHARE, floor: float = GRACE_FLOOR_S, spread: float = 0.0,
                  retry_after: float | None = None) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**attempt)].

    `spread` widens the first attempt's window (attempt 0) to [0, min(cap, spread)]: a fleet that lost
    the server at once comes back spread out (`RESTART_SPREAD_S`). `retry_after` is what a busy server
    asked for (HTTP 503 `Retry-After`, see `retry_after_of`): then the delay is uniform in
    [retry_after, 2 * retry_after] whatever the attempt — the server sets the pace (its Retry-After grows
    with the crowd), and a device refused as busy several times does not drift to the 30 s cap — and
    the refused devices do not all return in the same second either.

    `grace_left`, when given and positive, is how much is left of the grace period the server keeps
    this device's work for (the device owes it results): the upper bound is then also held to
    `grace_share * grace_left` (never below `floor`), so that attempts keep coming inside the
    window however many failed before. Once the window has closed (None, or <= 0) the plain capped
    exponential backoff applies again."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    upper = min(cap, base * 2.0 ** min(attempt, 64))
    if attempt == 0 and spread > upper:
        upper = min(cap, spread)
    if grace_left is not None and grace_left > 0:
        upper = min(upper, max(floor, grace_share * grace_left))
    if retry_after is not None and retry_after > 0:  # the server paces: its wait, jittered over as long again
        wait = min(retry_after, RETRY_AFTER_MAX_S)
        return wait + rand() * wait
    return rand() * upper


class Backoff:
    """The wait before each reconnection attempt of one `DeviceConnection`, and the step it is drawn at.

    Outside a grace window the wait is `backoff_delay(step)`: full jitter in [0, min(cap, base * 2**step)], the
    step raised by one after each failed round of server URLs (`ServerURLs.advance`), not when a busy server set
    the pace (`retry_after`), and back to 0 when a link that registered ends after staying up `stable_after`
    seconds (a link that registers and drops sooner leaves it as it was: a server that accepts and drops its
    devices keeps being backed off from). The first attempt after a link that was up is spread over `spread`
    seconds when the step is 0.

    Inside a grace window (`grace_left`: the device owes the server results, and the server keeps its batches
    that much longer) the attempts are paced by their own count in that window, starting from the step, each
    bounded by a share of the grace left (`backoff_delay`'s `grace_left`), and they never raise the step: when
    the window closes, the backoff goes on from the step it had when the window opened (the first one, after a
    stable link), not from the exponent the window's dense attempts reached.

    `next_wait` is the whole schedule: a pure function of these counts, `uptime`, `grace_left`,
    `retry_after` and `rand` (no clock), so it is tested without sockets."""

    def __init__(self, base: float = 0.5, cap: float = 30.0, spread: float = RESTART_SPREAD_S,
                 stable_after: float = 10.0, rand: Callable[[], float] = random.random) -> None:
        self.base = base
        self.cap = cap
        self.spread = spread
        self.stable_after = stable_after
        self.rand = rand
        self.step = 0  # the exponent outside grace windows
        self.in_window = 0  # attempts paced inside the current grace window

    def next_wait(self, *, uptime: float | None, round_done: bool, grace_left: float | None = None,
                  retry_after: float | None = None) -> float:
        """Seconds to wait before the next attempt, after one that ended: `uptime` is how long it stayed up
        when it had registered (None: it never did); `round_done` whether it completed a round of every server
        URL; `grace_left` the seconds left of the server's grace period while the device owes it something
        (None or <= 0: no window); `retry_after` what a busy server asked for."""
        if uptime is not None:  # a registered link ended: a new grace window (if one) starts with it
            self.in_window = 0
            if uptime >= self.stable_after:
                self.step = 0
        paced = retry_after is None and round_done
        if grace_left is not None and grace_left > 0:
            exponent = self.step + self.in_window
            if paced:
                self.in_window += 1
        else:
            exponent = self.step
            if paced:
                self.step += 1
        return backoff_delay(exponent, self.base, self.cap, self.rand, grace_left=grace_left,
                             spread=self.spread if uptime is not None else 0.0, retry_after=retry_after)


def retry_after_of(exc: BaseException) -> float | None:
    """The seconds a server refusing the handshake as busy (HTTP 503/429 with `Retry-After`) asked for."""
    if not isinstance(exc, InvalidStatus) or exc.response.status_code not in (429, 503):
        return None
    value = exc.response.headers.get("Retry-After")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 86_400 else None


def attempt_timeout(connect_timeout: float, grace_left: float | None, minimum: float = 1.0) -> float:
    """How long one connection attempt may take: `connect_timeout`, but inside a grace window no
    more than half of what is left of it (and at least `minimum`), so that one attempt stuck on a
    black-holed link does not use up the window."""
    if grace_left is None or grace_left <= 0:
        return connect_timeout
    return min(connect_timeout, max(minimum, grace_left / 2))


def describe_failure(exc: BaseException) -> str:
    """A failed attempt in a few words, for the log and `last_error`."""
    if isinstance(exc, InvalidStatus):
        return f"the server answered HTTP {exc.response.status_code} instead of a WebSocket"
    if isinstance(exc, ConnectionClosed):
        frame = exc.rcvd
        return (f"connection closed ({frame.code}{': ' + frame.reason if frame.reason else ''})"
                if frame else "connection lost")
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class ServerURLs:
    """The server URLs a device may use (a cluster's nodes, or one server), tried in turn.

    The device stays on the URL that works; when an attempt fails or a connection that was up is lost
    it moves to the next one, since the node it was on may be the one that died. The backoff is for the
    service as a whole, not for each node: `advance()` says when a whole round of URLs has been tried,
    and only then does the device's attempt count (and so its full-jitter wait) grow — a dead node
    costs the device one short wait before the next node, not a growing one. With one URL every
    failure ends a round, which is the single-server schedule unchanged."""

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("at least one server URL is needed")
        self.urls = list(dict.fromkeys(urls))  # the same node twice would only double its share
        self.index = 0
        self._since_up = 0  # URLs moved past since the last registration

    @property
    def current(self) -> str:
        return self.urls[self.index]

    def registered(self) -> None:
        self._since_up = 0

    def advance(self) -> bool:
        """Move to the next URL; True when that completes a round of every URL since the last registration."""
        self.index = (self.index + 1) % len(self.urls)
        self._since_up += 1
        return self._since_up % len(self.urls) == 0


class FailureLog:
    """What the log says about failed attempts in a row: a fleet whose server is down retries for minutes,
    and a WARNING (a formatted, written line) per attempt per device was a good share of its CPU.

    The first failure of a kind (the URL and the failure's words) is a WARNING, as is every new kind;
    the same failure again is DEBUG, and at most once every `every` seconds a WARNING says it still goes
    on (how many attempts, for how long). A success after failures says so at once. Only the log is
    thinned: `last_error` and the state hooks see every attempt."""

    def __init__(self, log: logging.Logger, every: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.every = every
        self.clock = clock
        self.attempts = 0  # failed attempts since the last success
        self._since = 0.0
        self._last_warning = 0.0
        self._seen: set[tuple[str, str]] = set()

    def failed(self, url: str, error: str, template: str = "cannot connect to %s: %s") -> None:
        """One failed attempt; `template` takes the URL and the failure (the WARNING's words)."""
        now = self.clock()
        self.attempts += 1
        if self.attempts == 1:
            self._since = now
        kind = (url, error)
        # (a failure whose words change each time counts as new only until _KINDS_MAX kinds were seen)
        if kind not in self._seen and len(self._seen) < _KINDS_MAX:
            self._seen.add(kind)
            self.log.warning(template, url, error)
            self._last_warning = now
            return
        if now - self._last_warning >= self.every:
            self.log.warning("still cannot connect to %s after %d attempts in %.0fs: %s", url, self.attempts,
                             now - self._since, error)
            self._last_warning = now
        elif self.log.isEnabledFor(logging.DEBUG):
            self.log.debug(template, url, error)

    def succeeded(self, url: str) -> None:
        """Registered: the failures before it, if any, end here."""
        if self.attempts:
            self.log.warning("reconnected to %s after %d failed attempt(s) in %.1fs", url, self.attempts,
                             self.clock() - self._since)
        self.attempts = 0
        self._seen.clear()


_KINDS_MAX = 16
