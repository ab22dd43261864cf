"""Token buckets, and the server's throttles built of them: failed credential checks and pairing claims.

A bucket per key (a client address, a pairing code) holds up to `burst` tokens and gains
`per_second` of them back; an attempt takes one, and a key with less than one token left is refused
with the seconds until it has one again (the 429's `Retry-After`). Only keys whose bucket is not
full are kept, and at most `max_keys` of them: a full bucket is the same as no bucket, so forgetting
it changes nothing, and an attacker who makes up addresses or codes cannot grow the table without
bound (past `max_keys` the oldest half is forgotten, which can only let the oldest attempts' keys
try again early).

`Throttles` is what the request guard (the request_guard package) consults:

- **failed credential checks** per client address: every answer 401 to a request that carried a
  credential (an `Authorization` header, a dashboard login) takes a token; while the address
  has none, its requests carrying credentials are answered 429 without being checked, so a correct
  guess cannot be told from a wrong one;
- **pairing claims** per client address and per code: every claim takes a token of both.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from tether.server.settings import ServerSettings

DEFAULT_MAX_KEYS = 65_536


class TokenBuckets:
    """One token bucket per key (see the module docstring). Not thread-safe: the server's event loop
    is its only user."""

    __slots__ = ("_buckets", "_clock", "burst", "max_keys", "per_second")

    def __init__(self, burst: float, per_second: float, *, max_keys: int = DEFAULT_MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1 or per_second <= 0:
            raise ValueError("a token bucket needs burst >= 1 and per_second > 0")
        self.burst = float(burst)
        self.per_second = per_second
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, when counted)

    def _tokens(self, key: str, now: float) -> float:
        entry = self._buckets.get(key)
        if entry is None:
            return self.burst
        tokens, then = entry
        return min(self.burst, tokens + (now - then) * self.per_second)

    def wait(self, key: str) -> float:
        """Seconds until `key` may try again (0.0: it may now); takes nothing."""
        if key not in self._buckets:  # the common case: a key that never spent anything
            return 0.0
        now = self._clock()
        tokens = self._tokens(key, now)
        if tokens >= self.burst:
            del self._buckets[key]
            return 0.0
        return 0.0 if tokens >= 1 else (1 - tokens) / self.per_second

    def take(self, key: str) -> float:
        """Spend one token of `key`: 0.0 when there was one, else the seconds until there is (nothing
        is spent then)."""
        now = self._clock()
        tokens = self._tokens(key, now)
        if tokens < 1:
            return (1 - tokens) / self.per_second
        if key not in self._buckets and len(self._buckets) >= self.max_keys:
            self._forget(now)
        self._buckets[key] = (tokens - 1, now)
        return 0.0

    def _forget(self, now: float) -> None:
        full = [k for k, (tokens, then) in self._buckets.items()
                if tokens + (now - then) * self.per_second >= self.burst]
        for key in full:
            del self._buckets[key]
        if len(self._buckets) >= self.max_keys:
            for key in list(self._buckets)[: len(self._buckets) // 2]:  # insertion order: the oldest first
                del self._buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)

    def __contains__(self, key: object) -> bool:
        """Whether `key` has spent anything not yet given back (a key not in it may certainly go on)."""
        return key in self._buckets


def retry_after(seconds: float) -> str:
    """A `Retry-After` value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


@dataclass(frozen=True)
class Throttled:
    """A refused attempt: what to answer (429) and when to come back."""

    error: str
    seconds: float

    @property
    def retry_after(self) -> str:
        return retry_after(self.seconds)


class Throttles:
    """The server's rate limits at the edge (see the module docstring), one instance per app."""

    def __init__(self, settings: ServerSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.auth_failures = TokenBuckets(settings.auth_failure_burst, settings.auth_failures_per_minute / 60,
                                          clock=clock)
        per_second = settings.pairing_claims_per_minute / 60
        self.claims = TokenBuckets(settings.pairing_claim_burst, per_second, clock=clock)
        self.claims_per_code = TokenBuckets(max(1, settings.pairing_claim_burst // 2), per_second / 3, clock=clock)

    def credentials_blocked(self, address: str) -> Throttled | None:
        """Whether requests carrying credentials from `address` are refused now (too many failed)."""
        wait = self.auth_failures.wait(address)
        if wait <= 0:
            return None
        return Throttled(f"too many failed credential checks from {address}; try again in "
                         f"{retry_after(wait)} s (server settings auth_failure_burst, auth_failures_per_minute)", wait)

    def credentials_failed(self, address: str) -> None:
        """Count a failed credential check of `address`."""
        self.auth_failures.take(address)

    def claim(self, address: str, code: str) -> Throttled | None:
        """Spend a pairing claim of `address` and of `code`; the refusal when either has none left."""
        wait = self.claims.take(address)
        if wait <= 0:
            wait = self.claims_per_code.take(code.strip().upper()[:64])
        if wait <= 0:
            return None
        return Throttled(f"too many pairing claims; try again in {retry_after(wait)} s "
                         "(server settings pairing_claim_burst, pairing_claims_per_minute)", wait)


NO_SUCH_CLAIM = "no pairing request with this code for this key; check the code, or start pairing again"
_WRONG_KEY_MARK = "belongs to another device"  # pairing.PairingBook.claim's 403 for a key that is not the code's


def claim_refusal(status: int, error: str) -> tuple[int, str]:
    """The answer to a failed pairing claim: an unknown code (404) and a key that is not the code's (403)
    get one and the same (404, `NO_SUCH_CLAIM`), so that a claim cannot tell whether a code exists;
    every other refusal (refused, expired, already used) goes only to a claim whose key matched, and
    passes as it is."""
    if status == 404 or (status == 403 and _WRONG_KEY_MARK in error):
        return 404, NO_SUCH_CLAIM
    return status, error
