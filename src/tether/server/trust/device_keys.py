"""Which key each device is: the `device_keys` table (name -> Ed25519 public key) and its rules.

A device's key is enrolled once, in one of three ways, and `enrolled_by` says which:
- at pairing: the admin approves a request and the key that asked is the device (`pairing CODE by WHO`);
- by the admin: `tether token create|rotate --device NAME --key PUBLIC_KEY`, or `POST /api/v1/tokens`
  with `public_key` (`admin`);
- on first use: a token created without a key lets the first registration that proves a key enrol it
  (`first registration`), once. From then on every token of that name needs that key.
A different key is enrolled only by the admin's explicit choice: pairing with replace, or rotate.
"""

from __future__ import annotations

from tether.server.store import Store
from tether.server.store.devices import EnrolledKey

FIRST_REGISTRATION = "first registration"
MAX_KEY_TEXT = 1000  # a PEM Ed25519 public key is 113 characters; anything much longer is not one


def parse_public_key(text: str) -> str:
    """A device's Ed25519 public key as an admin gives it, in the form the server stores and compares:
    43 characters of unpadded base64url (as `tether device key` prints it). Also accepted: the same 32
    bytes in standard or padded base64, and a PEM `PUBLIC KEY` (SubjectPublicKeyInfo). ValueError says
    what is wrong with anything else (another kind of key, a private key, text that is no key)."""
    import base64
    import binascii

    from tether.protocol.identity import b64encode, valid_public_key

    key = text.strip()
    if not key or len(key) > MAX_KEY_TEXT:
        raise ValueError("public_key is empty or too long to be a device's Ed25519 public key")
    if key.startswith("-----BEGIN"):
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            loaded = serialization.load_pem_public_key(key.encode("ascii", "replace"))
        except (ValueError, TypeError):
            raise ValueError("public_key is PEM text but not a public key (give the device's PUBLIC KEY, never a "
                             "private one)") from None
        if not isinstance(loaded, Ed25519PublicKey):
            raise ValueError(f"public_key is a {type(loaded).__name__.removesuffix('PublicKey') or 'non-Ed25519'} "
                             "key; a device's key is Ed25519")
        return b64encode(loaded.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))
    try:
        raw = base64.b64decode(key.replace("-", "+").replace("_", "/") + "=" * (-len(key) % 4), validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    normal = b64encode(raw)
    if len(raw) != 32 or not valid_public_key(normal):
        raise ValueError(f"public_key {key[:60]!r} is not a device's Ed25519 public key (43 characters of unpadded "
                         "base64url, as 'tether device key' prints it, or a PEM PUBLIC KEY)")
    return normal


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
