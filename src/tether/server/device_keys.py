"""Which key each device is: the `device_keys` table (name -> Ed25519 public key) and its rules.

A device's key is enrolled once, in one of three ways, and `enrolled_by` says which:
- at pairing: the admin approves a request and the key that asked is the device (`pairing CODE by WHO`);
- by the admin: `tether token create|rotate --device NAME --key PUBLIC_KEY` (`admin`);
- on first use: a token created without a key lets the first registration that proves a key enrol it
  (`first registration`), once. From then on every token of that name needs that key.
A different key is enrolled only by the admin's explicit choice: pairing with replace, or rotate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tether.server.store import Store

FIRST_REGISTRATION = "first registration"


@dataclass(frozen=True)
class EnrolledKey:
    name: str
    public_key: str
    enrolled_at: float
    enrolled_by: str


def device_key(store: Store, name: str) -> EnrolledKey | None:
    """The key enrolled for device `name`, or None."""
    rows = store.read("SELECT public_key, enrolled_at, enrolled_by FROM device_keys WHERE name = ?", (name,))
    if not rows:
        return None
    row = rows[0]
    return EnrolledKey(name, row[0], row[1], row[2])


def enroll_first(store: Store, name: str, public_key: str, by: str = FIRST_REGISTRATION) -> str:
    """Enrol `public_key` for `name` unless a key is enrolled already; the key enrolled now (the one
    given, or the one that was there: a caller compares)."""
    store.write("INSERT INTO device_keys (name, public_key, enrolled_at, enrolled_by) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (name) DO NOTHING", (name, public_key, time.time(), by))
    enrolled = device_key(store, name)
    return enrolled.public_key if enrolled is not None else public_key


def set_device_key(store: Store, name: str, public_key: str | None, by: str) -> None:
    """Enrol `public_key` for `name` in place of any key it had; None forgets the key (the next
    registration that proves one enrols it)."""
    if public_key is None:
        store.write("DELETE FROM device_keys WHERE name = ?", (name,))
        return
    store.write("INSERT INTO device_keys (name, public_key, enrolled_at, enrolled_by) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET public_key = excluded.public_key, "
                "enrolled_at = excluded.enrolled_at, enrolled_by = excluded.enrolled_by",
                (name, public_key, time.time(), by))


def device_exists(store: Store, name: str) -> bool:
    """True when `name` is a device already: it has a key, an active device token, or has registered."""
    if device_key(store, name) is not None:
        return True
    if store.read("SELECT 1 FROM tokens WHERE kind = 'device' AND name = ? AND revoked_at IS NULL", (name,)):
        return True
    return bool(store.read("SELECT 1 FROM devices WHERE name = ?", (name,)))


def collision(store: Store, name: str | None, public_key: str | None) -> str | None:
    """Why a new identity with this key cannot take `name` silently, or None when it may (the name is
    free, or it is this very key's already)."""
    if not name:
        return None
    enrolled = device_key(store, name)
    if enrolled is not None:
        if public_key is not None and enrolled.public_key == public_key:
            return None
        return f"device '{name}' exists with another key (enrolled by {enrolled.enrolled_by})"
    if device_exists(store, name):
        return f"device '{name}' exists (a token or a past registration)"
    return None


def revoke_device_tokens(store: Store, name: str) -> int:
    """Revoke every active device token of `name`; how many."""
    return store.write("UPDATE tokens SET revoked_at = ? WHERE kind = 'device' AND name = ? AND revoked_at IS NULL",
                       (time.time(), name))
