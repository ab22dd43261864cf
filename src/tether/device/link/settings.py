"""What a `DeviceConnection` is given: its settings, the server certificate it trusts, who it tells, and the
socket's fixed limits."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from tether.device.link.batch_runner import DEFAULT_MAX_CONCURRENT_SESSIONS
from tether.device.link.finished import DEFAULT_RECORD_BYTES
from tether.device.link.reconnect import RESTART_SPREAD_S

ConnectionState = Literal["idle", "connecting", "registered", "disconnected", "refused", "stopped"]
# (state, the DeviceConnection)
StateHook = Callable[[ConnectionState, Any], None]

# The socket's own hard limit, only a guard against absurd frames: the protocol's limit (from the
# ACK) is checked on each frame so that an oversized frame gets an ERROR reply, not a closed link.
TRANSPORT_MAX_BYTES = 64 * 1024 * 1024
KEEPALIVE_S = 20.0
# A profile collected for an attempt that never registered serves the next attempts for this long: a
# device retrying a server that is down does not run its self-checks (a thread, nvidia-smi, lspci) per
# attempt, and the profile is collected before connecting, so a socket admitted by a busy server does
# not sit on its admission slot while the device probes its hardware.
PROFILE_REUSE_S = 60.0


def make_ssl_context(url: str, ca_file: str | None = None) -> ssl.SSLContext | None:
    """TLS settings for `url`: None for ws://; for wss:// the server's certificate and host name are
    verified against the system's CAs, or against `ca_file` (e.g. a self-signed server's cert)."""
    scheme = urlsplit(url).scheme
    if scheme == "ws":
        if ca_file:
            raise ValueError(f"a CA file was given but {url} is not a wss:// URL: nothing would be verified")
        return None
    if scheme != "wss":
        raise ValueError(f"{url}: the server URL must start with ws:// or wss://")
    return ssl.create_default_context(cafile=ca_file)


@dataclass(frozen=True)
class LinkSettings:
    """How a `DeviceConnection` retries, waits and buffers.

    `backoff_base`/`backoff_cap`: the exponential backoff between attempts (seconds, full jitter);
    `restart_spread`: the most the first attempt after a link that was up waits (a fleet spreads its
    reconnections after a server restart); `max_attempts`: failed attempts in a row before `run()` raises
    `RetriesExhausted` (None: never); `connect_timeout`: one attempt's handshake and registration;
    `stable_after`: how long a link must have stayed up for the backoff to start again from the base;
    `max_queued_events`: events kept while the link is slower than the tools (the oldest dropped);
    `record_size`/`record_bytes`: the finished calls remembered so a resent batch is answered, not rerun;
    `max_concurrent_sessions`: sessions whose batches run side by side."""

    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    restart_spread: float = RESTART_SPREAD_S
    max_attempts: int | None = None
    connect_timeout: float = 10.0
    stable_after: float = 10.0
    max_queued_events: int = 1000
    record_size: int = 10_000
    record_bytes: int = DEFAULT_RECORD_BYTES
    max_concurrent_sessions: int = DEFAULT_MAX_CONCURRENT_SESSIONS


@dataclass(frozen=True)
class ServerTrust:
    """Which server certificate a `DeviceConnection` accepts on wss://: `ssl_context` (None: the system's
    CAs, see `make_ssl_context`) or exactly the certificate with the SHA-256 `tls_fingerprint`
    (`tether.device.link.trust.tls_pin`; then `ssl_context` is not used)."""

    ssl_context: ssl.SSLContext | None = None
    tls_fingerprint: str | None = None
