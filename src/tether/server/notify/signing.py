"""Signatures of webhook bodies: HMAC-SHA256 over `"{timestamp}.{body}"` with the webhook's secret.

A delivery carries `X-Tether-Timestamp` (Unix seconds) and `X-Tether-Signature: v1=<hex>`; a receiver
recomputes the HMAC over the raw body, compares in constant time, and refuses timestamps older than a few
minutes (a replayed delivery). `verify` is that check, for receivers written in Python and for the tests.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

TIMESTAMP_HEADER = "X-Tether-Timestamp"
SIGNATURE_HEADER = "X-Tether-Signature"
TOLERANCE_S = 300.0


def new_secret() -> str:
    """A fresh signing secret (`whsec_` and 32 random bytes, URL-safe)."""
    return "whsec_" + secrets.token_urlsafe(32)


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The signature header's value for this body sent at `timestamp`: `v1=<hex HMAC-SHA256>`."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "v1=" + mac.hexdigest()


def verify(secret: str, timestamp: str | None, signature: str | None, body: bytes, *,
           now: float | None = None, tolerance: float = TOLERANCE_S) -> bool:
    """Whether `signature` signs `body` at `timestamp` with `secret`, and the timestamp is within `tolerance`
    seconds of `now`."""
    if not timestamp or not signature:
        return False
    try:
        sent = float(timestamp)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - sent) > tolerance:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), signature.strip())
