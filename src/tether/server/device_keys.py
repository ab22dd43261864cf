"""Which key each device is: the `device_keys` table (name -> Ed25519 public key) and its rules.

A device's key is enrolled once, in one of three ways, and `enrolled_by` says which:
- at pairing: the admin approves a request and the key that asked is the device (`pairing CODE by WHO`);
- by the admin: `tether token create|rotate --device NAME --key PUBLIC_KEY` (`admin`);
- on first use: a token created without a key lets the first registration that proves a key enrol it
  (`first registration`), once. From then on every token of that name needs that key.
A different key is enrolled only by the admin's explicit choice: pairing with replace, or rotate.
"""

from __future__ import annotations

from tether.server.store import Store
from tether.server.store.devices import EnrolledKey

FIRST_REGISTRATION = "first registration"


def device_key(store: Store, name: str) -> EnrolledKey | None:
    """The key enrolled for device `name`, or None."""
    return store.device_keys.get(name)


def enroll_first(store: Store, name: str, public_key: str, by: str = FIRST_REGISTRATION) -> str:
    """Enrol `public_key` for `name` unless a key is enrolled already; the key enrolled now (the one
    given, or the one that was there: a caller compares)."""
    store.device_keys.enroll_first(name, public_key, by)
    enrolled = device_key(store, name)
    return enrolled.public_key if enrolled is not None else public_key


def set_device_key(store: Store, name: str, public_key: str | None, by: str) -> None:
    """Enrol `public_key` for `name` in place of any key it had; None forgets the key (the next
    registration that proves one enrols it)."""
    if public_key is None:
        store.device_keys.forget(name)
        return
    store.device_keys.put(name, public_key, by)


def device_exists(store: Store, name: str) -> bool:
    """True when `name` is a device already: it has a key, an active device token, or has registered."""
    if device_key(store, name) is not None:
        return True
    if store.tokens.has_active_device(name):
        return True
    return store.devices.known(name)


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
    return store.tokens.revoke_device(name)
