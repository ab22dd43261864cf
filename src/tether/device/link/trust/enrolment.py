"""Enrolment from the device's side: ask to pair, show the code, wait for an admin, keep the token.

What pairing leaves in the device's state directory (all 0600, the directory 0700):
`device.key` (the device's Ed25519 private key, `tether.device.link.trust.device_key`: the request carries its
public half, whose SHA-256 the admin sees as this device's fingerprint, and the claim is signed with
it; the server enrols that public key as the device at approval, so the token it hands over is worth
nothing without this file), `device.token` (the device token the server handed over), and
`pairing.json` (the server, the name and tags the admin gave, and the server certificate's
fingerprint when it was trusted on first use). The next `tether device --server URL` finds the token
there and needs no flag.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tether.device.link.trust.device_key import KEY_FILE, DeviceKey, load_device_key
from tether.device.link.trust.tls_pin import (
    cert_fingerprint,
    fetch_certificate_async,
    pinned_context,
    pinned_context_for_async,
)
from tether.errors import DeviceError

TOKEN_FILE, STATE_FILE = "device.token", "pairing.json"
_CLAIM_WAIT = 25.0  # seconds the server holds one claim before answering "pending"


class PairingFailed(DeviceError, RuntimeError):
    """Pairing ended without a token: refused, expired, or the server said no; the message says which."""


@dataclass
class Enrolment:
    """What pairing gave this device, as kept in its state directory."""

    token: str
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    server: str | None = None
    tls_fingerprint: str | None = None


def http_base(url: str) -> str:
    """http(s)://host:port of a ws(s):// or http(s):// server URL, without the /aip path."""
    if url.startswith(("ws://", "wss://")):
        url = "http" + url[2:]
    return url.rstrip("/").removesuffix("/aip")


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def device_key(state_dir: Path) -> DeviceKey:
    """This device's key (`device.key` in `state_dir`), made on first use."""
    return load_device_key(state_dir / KEY_FILE)


def load_enrolment(state_dir: Path) -> Enrolment | None:
    """The token and details a past pairing stored, or None if this device never paired."""
    token_path = state_dir / TOKEN_FILE
    try:
        token = token_path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"cannot read {token_path}: {exc.strerror or exc}") from None
    if not token:
        return None
    try:
        details = json.loads((state_dir / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        details = {}
    return Enrolment(token=token, name=details.get("name"), tags=list(details.get("tags") or []),
                     server=details.get("server"), tls_fingerprint=details.get("tls_fingerprint"))


def save_enrolment(state_dir: Path, enrolment: Enrolment) -> None:
    _write_private(state_dir / TOKEN_FILE, enrolment.token + "\n")
    _write_private(state_dir / STATE_FILE, json.dumps({
        "server": enrolment.server, "name": enrolment.name, "tags": enrolment.tags,
        "tls_fingerprint": enrolment.tls_fingerprint, "paired_at": time.time()}, indent=2) + "\n")


async def tls_for_pairing(url: str, ca_file: str | None, pin: str | None,
                          note: Callable[[str], None]) -> tuple[ssl.SSLContext | None, str | None]:
    """How to trust the server while pairing, and the fingerprint to remember (trust on first use).

    A pin or a CA file is used as given. Otherwise the system's CAs are tried; a certificate they do
    not vouch for (a self-signed server) is trusted on first use: its fingerprint is shown, so it can
    be compared with the one `tether server` prints, and is pinned from then on.
    """
    if not url.startswith(("https://", "wss://")):
        return None, None
    if pin:
        return await pinned_context_for_async(url, pin), pin
    if ca_file:
        return ssl.create_default_context(cafile=ca_file), None
    der = await fetch_certificate_async(url)
    system = ssl.create_default_context()
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 443
    try:
        async with asyncio.timeout(10):
            _reader, writer = await asyncio.open_connection(host, port, ssl=system, server_hostname=host)
        writer.close()
        return system, None  # a certificate the system trusts: nothing to pin
    except ssl.SSLError:
        pass
    fingerprint = cert_fingerprint(der)
    note(f"the server's certificate is not signed by a CA this machine trusts; trusting it on first use: "
         f"SHA-256 {fingerprint} (compare with what 'tether server' printed)")
    return pinned_context(der), fingerprint


async def pair(url: str, state_dir: Path, *, name: str | None, ssl_context: ssl.SSLContext | None,
               show_code: Callable[[str, str], None], timeout: float = 30.0, key: DeviceKey | None = None) -> Enrolment:
    """Ask the server at `url` to pair, call `show_code(code, fingerprint)`, and wait for the admin.

    The request carries `key`'s public half (by default the key in `state_dir`), the claim a signature
    with it. Returns the enrolment (not yet saved); raises PairingFailed when refused or expired, and
    lets connection errors through for the caller to report.
    """
    import httpx

    from tether.protocol.identity import claim_statement

    key = key or device_key(state_dir)
    fingerprint = key.fingerprint  # what the server shows the admin
    base = http_base(url) + "/api/v1/pairing"
    verify: Any = ssl_context if ssl_context is not None else True
    async with httpx.AsyncClient(verify=verify, timeout=httpx.Timeout(timeout, read=_CLAIM_WAIT + timeout)) as http:
        body = _answer(await http.post(base, json={"public_key": key.public_key, "name": name,
                                                   "platform": platform.system().lower()}))
        code = body["code"]
        if body.get("fingerprint") != fingerprint:  # what the admin sees must be this key
            raise PairingFailed(f"the server took another key for this device ({body.get('fingerprint')!r})")
        show_code(code, fingerprint)
        signature = key.sign(claim_statement(code, fingerprint))
        while True:
            answer = _answer(await http.post(f"{base}/{code}/claim", json={"signature": signature,
                                                                          "wait": _CLAIM_WAIT}))
            if answer.get("status") == "paired":
                return Enrolment(token=answer["token"], name=answer.get("name"), tags=list(answer.get("tags") or []))


def _answer(response: Any) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.is_error:
        message = body.get("error") if isinstance(body, dict) else None
        raise PairingFailed(f"pairing refused ({response.status_code}): {message or response.text[:200]}")
    return body
