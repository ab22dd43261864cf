"""`PairingBook`: devices that enrol without a token, and the admin who lets them in.

A device with no token asks to pair: it sends the public half of its Ed25519 key (never the private
key) and gets a short code. It shows the code and the key's fingerprint (SHA-256 of the public key);
an admin sees both in `tether devices pending` and approves the code (naming the device, tagging it)
or refuses it. Approving enrols that public key as the device (`tether.server.trust.device_keys`): every
registration of the device must prove it, so the token is worth nothing without the key. The device
then claims its token with a signature of the code (`identity.claim_statement`), so a second device
that read the code off a screen cannot take the token. Until then the device has no credential at
all, so nothing can be run on it or by it.

A request never takes an existing device's name silently: `pending()` marks a request whose name is
taken by another identity (`collision`), and approving it under that name is refused unless the admin
chooses `replace`, which revokes the old device's tokens and enrols the new key in place of its own.

The token's secret exists only in this process's memory between the approval and the claim (the
store keeps its hash, as for every token); if the server restarts in between, the approval is
undone at start-up (its token revoked, the request pending again), so no secret ever sits on disk.
Requests expire, are rate-limited per address and capped in number, and every decision is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tether.errors import ServerError
from tether.protocol.identity import claim_statement, fingerprint, valid_public_key, verify
from tether.protocol.names import device_name_problem
from tether.server.store import Store
from tether.server.store.pairing import PAIRED, PENDING, REFUSED
from tether.server.trust.device_keys import collision, revoke_device_tokens, set_device_key

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford's base 32: no I, L, O, U to misread


class PairingError(ServerError):
    """A refusal with the HTTP status the API answers it with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class PairingLimits:
    ttl: float = 600.0  # a request not approved within this is gone
    per_address: int = 5  # requests one address may make ...
    per_address_window: float = 60.0  # ... in this many seconds
    max_pending: int = 1000  # open requests from everyone together
    max_wait: float = 30.0  # the longest one claim request waits for a decision


@dataclass
class _Waiters:
    event: asyncio.Event = field(default_factory=asyncio.Event)
    count: int = 0  # claims waiting now: the entry goes with the last of them


def new_code() -> str:
    raw = "".join(secrets.choice(_ALPHABET) for _ in range(8))
    return f"{raw[:4]}-{raw[4:]}"


def normalize_code(code: str) -> str:
    """Codes are read aloud and typed: any case, with or without the dash, O/I/L read as 0/1/1."""
    cleaned = code.strip().upper().replace("-", "").replace(" ", "")
    cleaned = cleaned.translate(str.maketrans("OIL", "011"))
    return f"{cleaned[:4]}-{cleaned[4:]}" if len(cleaned) == 8 else cleaned


class PairingBook:
    """Pairing requests, their decisions and the handing over of tokens (see the module's docstring)."""

    def __init__(self, store: Store, limits: PairingLimits | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        """`on_change` is called after a request arrives or is decided (the dashboard's fleet stream wakes on it);
        `version` counts those changes."""
        self.store = store
        self.limits = limits or PairingLimits()
        self.version = 0
        self._on_change = on_change
        self._recent: dict[str, deque[float]] = {}  # address -> times of its recent requests
        self._secrets: dict[str, tuple[str, str]] = {}  # code -> (token secret, token id), approved, not claimed
        self._waiters: dict[str, _Waiters] = {}
        self._undo_lost_approvals()

    def _undo_lost_approvals(self) -> None:
        for row in self.store.pairing.approved():
            if row["token_id"]:
                self.store.tokens.revoke_id(row["token_id"])
            if row["device_name"]:  # the key that approval enrolled goes with it (a replaced device's is gone)
                self.store.device_keys.forget_enrolled_by(row["device_name"], f"pairing {row['code']} %")
            self.store.pairing.reopen(row["code"])

    # -- the device's side ------------------------------------------------------------------------

    async def request(self, public_key: str, address: str, name: str | None = None,
                      platform: str | None = None) -> dict[str, Any]:
        """A new request of the device whose Ed25519 public key is `public_key` (unpadded base64url): its code,
        fingerprint and expiry. `PairingError` for a bad key or name (422) or past the limits (429). The
        statements run on the store's pool (`Store.call`), so a locked table holds only this request."""
        if not valid_public_key(public_key):
            raise PairingError(422, "public_key must be an Ed25519 public key: 32 bytes, unpadded base64url")
        if name and (problem := device_name_problem(name)) is not None:  # the same rule as at approval
            raise PairingError(422, f"{problem}; ask again with --name")
        key_print = fingerprint(public_key)
        now = time.time()
        self._rate_limit(address, now)
        answer = await self.store.call(self._add_request, public_key, key_print, address, name, platform, now)
        self._changed()
        return answer

    def _add_request(self, public_key: str, key_print: str, address: str, name: str | None, platform: str | None,
                     now: float) -> dict[str, Any]:
        self.store.pairing.drop_expired(now)
        pending = self.store.pairing.count_pending()
        if pending >= self.limits.max_pending:
            raise PairingError(429, f"{pending} pairing requests are already waiting; try again later")
        for old in self.store.pairing.pending_codes(key_print):
            self.store.pairing.delete(old)  # the same device asks again
        code = new_code()
        expires = now + self.limits.ttl
        self.store.pairing.add(code, key_print, public_key, address, (name or "")[:128] or None,
                               (platform or "")[:64] or None, now, expires)
        return {"code": code, "fingerprint": key_print, "expires_at": expires}

    def _rate_limit(self, address: str, now: float) -> None:
        window = self.limits.per_address_window
        for other in [a for a, times in self._recent.items() if not times or times[-1] < now - window]:
            del self._recent[other]  # forget quiet addresses: the dict stays as small as the recent traffic
        times = self._recent.setdefault(address, deque())
        while times and times[0] < now - window:
            times.popleft()
        if len(times) >= self.limits.per_address:
            raise PairingError(429, f"too many pairing requests from {address}; wait {window:.0f} s")
        times.append(now)

    async def claim(self, code: str, signature: str, wait: float) -> dict[str, Any]:
        """The token once the code is approved; waits up to `wait` seconds for a decision first.
        Answers {"status": "pending"} if none came, so the device asks again. `signature` is the
        requesting key's signature of `identity.claim_statement(code, fingerprint)`."""
        code = normalize_code(code)
        row = await self.store.call(self._row, code)
        if not row["public_key"] or not verify(row["public_key"], signature,
                                               claim_statement(code, row["fingerprint"])):
            raise PairingError(403, "this pairing code belongs to another device")
        if row["status"] == PENDING:
            waiter = self._waiters.setdefault(code, _Waiters())
            waiter.count += 1
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, min(wait, self.limits.max_wait,
                                                            row["expires_at"] - time.time()))):
                        await waiter.event.wait()
            finally:
                waiter.count -= 1
                if waiter.count == 0 and self._waiters.get(code) is waiter:
                    del self._waiters[code]
            row = await self.store.call(self._row, code)
        status = row["status"]
        if status == PENDING:
            if row["expires_at"] < time.time():
                raise PairingError(410, "the pairing request expired; start pairing again")
            return {"status": PENDING, "expires_at": row["expires_at"]}
        if status == REFUSED:
            raise PairingError(403, "an admin refused this device")
        if status == PAIRED:
            raise PairingError(409, "this code was already used to pair; start pairing again")
        taken = self._secrets.pop(code, None)
        if taken is None:  # approved by another server process sharing the file: the secret is not here
            raise PairingError(409, "the approval was made elsewhere; ask the admin to approve again")
        secret, _ = taken
        await self.store.call(self.store.pairing.mark_paired, code)
        return {"status": PAIRED, "token": secret, "name": row["device_name"], "tags": json.loads(row["tags"])}

    def _row(self, code: str) -> Any:
        row = self.store.pairing.get(code)
        if row is None:
            raise PairingError(404, f"no pairing request with code {code}")
        if row["status"] == PENDING and row["expires_at"] < time.time():
            raise PairingError(410, f"the pairing request {code} expired; start pairing again")
        return row

    # -- the admin's side -------------------------------------------------------------------------

    async def pending(self) -> list[dict[str, Any]]:
        """The open requests, each with `collision`: why its name is taken by another identity, else None."""
        return await self.store.call(self._pending_rows)

    def _pending_rows(self) -> list[dict[str, Any]]:
        now = time.time()
        rows = self.store.pairing.open_requests(now)
        return [{"code": r["code"], "fingerprint": r["fingerprint"], "address": r["address"],
                 "requested_name": r["requested_name"], "platform": r["platform"], "created_at": r["created_at"],
                 "expires_at": r["expires_at"],
                 "collision": collision(self.store, r["requested_name"], r["public_key"])} for r in rows]

    async def approve(self, code: str, name: str | None, tags: list[str], by: str,
                      replace: bool = False) -> dict[str, Any]:
        """Let the request in as device `name` (default: the name it asked for): its key is enrolled as
        that device and a token is made for the claim. A name another identity holds is refused (409)
        unless `replace`: then that device's tokens are revoked and its key replaced by this one. The
        statements run on the store's pool; the claims waiting for this code are woken after, on the loop."""
        code = normalize_code(code)
        answer, secret = await self.store.call(self._approve_rows, code, name, tags, by, replace)
        self._secrets[code] = (secret, answer["token_id"])
        self._wake(code)
        self._changed()
        return answer

    def _approve_rows(self, code: str, name: str | None, tags: list[str], by: str,
                      replace: bool) -> tuple[dict[str, Any], str]:
        row = self._row(code)
        if row["status"] != PENDING:
            raise PairingError(409, f"pairing request {code} is already {row['status']}")
        device_name = name or row["requested_name"]
        if not device_name:
            raise PairingError(422, "the device asked for no name: give one (--name)")
        if (problem := device_name_problem(device_name)) is not None:
            raise PairingError(422, f"{problem}; approve it with --name")
        if not row["public_key"]:
            raise PairingError(409, f"pairing request {code} carries no device key; the device must ask again")
        taken = collision(self.store, device_name, row["public_key"])
        if taken is not None and not replace:
            raise PairingError(409, f"{taken}: approving this request would take its name. Approve it under another "
                                    "name, or replace that device (its tokens and key stop working)")
        replaced = revoke_device_tokens(self.store, device_name) if taken is not None else 0
        try:
            info, secret = self.store.tokens.create("device", device_name)
        except ValueError as exc:
            raise PairingError(422, str(exc)) from None
        changed = self.store.pairing.approve(code, device_name, json.dumps(tags), info.id, by)
        if not changed:  # decided by someone else meanwhile
            self.store.tokens.revoke(info.id)
            raise PairingError(409, f"pairing request {code} was decided meanwhile")
        set_device_key(self.store, device_name, row["public_key"], f"pairing {code} by {by}")
        return ({"code": code, "name": device_name, "tags": tags, "token_id": info.id,
                 "fingerprint": row["fingerprint"], "replaced": taken is not None, "revoked_tokens": replaced}, secret)

    async def refuse(self, code: str, by: str) -> dict[str, Any]:
        """Refuse the request (409 if it was decided already); the claims waiting for it are told."""
        code = normalize_code(code)
        await self.store.call(self._refuse_row, code, by)
        self._wake(code)
        self._changed()
        return {"code": code, "status": REFUSED}

    def _refuse_row(self, code: str, by: str) -> None:
        row = self._row(code)
        if row["status"] != PENDING:
            raise PairingError(409, f"pairing request {code} is already {row['status']}")
        self.store.pairing.refuse(code, by)

    def _changed(self) -> None:
        self.version += 1
        if self._on_change is not None:
            self._on_change()

    def _wake(self, code: str) -> None:
        waiter = self._waiters.pop(code, None)
        if waiter is not None:
            waiter.event.set()
