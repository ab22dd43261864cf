"""TLS pinning: trust exactly one server certificate, named by its SHA-256 fingerprint.

A self-signed server has no CA to name with `--ca-file` until someone copies its certificate over;
a fingerprint is a line an admin can read out (`openssl x509 -noout -fingerprint -sha256`) or that
pairing records on first use. Python's `ssl` has no verify callback, so the check is done in two
steps that together leave no gap: the server's certificate is fetched on a throw-away handshake and
compared with the pin, then the real connection is made with a context whose only trust anchor is
that certificate (partial-chain verification, host name not checked: the pin replaces both). A
server that swaps its certificate between the two handshakes fails the second one, and nothing —
no token, no byte of HTTP — is sent before a verified handshake.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import socket
import ssl
from urllib.parse import urlsplit

from tether.errors import DeviceError

_HEX = re.compile(r"^[0-9a-f]{64}$")


class PinMismatch(DeviceError, ValueError):
    """The server presented a certificate other than the pinned one."""


def normalize_fingerprint(text: str) -> str:
    """64 lower-case hex digits from what people paste: `SHA256:`-prefixed, colon- or space-separated."""
    cleaned = text.strip().lower()
    for prefix in ("sha256:", "sha256="):
        cleaned = cleaned.removeprefix(prefix)
    cleaned = re.sub(r"[\s:]", "", cleaned)
    if not _HEX.match(cleaned):
        raise ValueError(f"not a SHA-256 certificate fingerprint: {text!r} (64 hex digits, e.g. from "
                         "'openssl x509 -noout -fingerprint -sha256 -in cert.pem')")
    return cleaned


def cert_fingerprint(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def show_fingerprint(fingerprint: str) -> str:
    """The colon form `openssl` prints, so the two can be compared by eye."""
    upper = fingerprint.upper()
    return ":".join(upper[i:i + 2] for i in range(0, len(upper), 2))


def _probe_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only to read the certificate; nothing is sent on this connection
    return context


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("wss", "https"):
        raise ValueError(f"a TLS fingerprint was given but {url} is not a wss:// or https:// URL")
    if not parts.hostname:
        raise ValueError(f"{url}: no host name")
    return parts.hostname, parts.port or 443


def fetch_certificate(url: str, timeout: float = 10.0) -> bytes:
    """The DER certificate the server at `url` presents (blocking; for the CLI's one-off requests)."""
    host, port = _host_port(url)
    with socket.create_connection((host, port), timeout=timeout) as raw, \
            _probe_context().wrap_socket(raw, server_hostname=host) as tls:
        der = tls.getpeercert(binary_form=True)
    if not der:
        raise ConnectionError(f"{host}:{port} presented no certificate")
    return der


async def fetch_certificate_async(url: str, timeout: float = 10.0) -> bytes:
    host, port = _host_port(url)
    async with asyncio.timeout(timeout):
        _reader, writer = await asyncio.open_connection(host, port, ssl=_probe_context(), server_hostname=host)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
    if not der:
        raise ConnectionError(f"{host}:{port} presented no certificate")
    return der


def pinned_context(der: bytes) -> ssl.SSLContext:
    """A client context that trusts this one certificate and nothing else."""
    context = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(der))
    context.check_hostname = False  # the pin names the certificate; a host name adds nothing
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a leaf signed by a private CA is an anchor too
    return context


def check_pin(der: bytes, fingerprint: str, url: str) -> None:
    seen = cert_fingerprint(der)
    if not hmac.compare_digest(seen, fingerprint):
        raise PinMismatch(f"{url} presented a certificate with SHA-256 fingerprint {show_fingerprint(seen)}, not the "
                          f"pinned {show_fingerprint(fingerprint)}: refusing to send anything (if the server's "
                          "certificate was replaced on purpose, pass its new fingerprint with --tls-fingerprint)")


def pinned_context_for(url: str, fingerprint: str, timeout: float = 10.0) -> ssl.SSLContext:
    der = fetch_certificate(url, timeout)
    check_pin(der, fingerprint, url)
    return pinned_context(der)


async def pinned_context_for_async(url: str, fingerprint: str, timeout: float = 10.0) -> ssl.SSLContext:
    der = await fetch_certificate_async(url, timeout)
    check_pin(der, fingerprint, url)
    return pinned_context(der)
