"""A device's identity on the wire: its Ed25519 public key and the proofs it signs (sans-I/O).

A device is its key, not its token: the token is a bearer secret that anything reading it can replay,
the key never leaves the device. At every registration the server hands the device a fresh random
challenge (the `X-Tether-Challenge` header of the WebSocket upgrade's answer, `CHALLENGE_HEADER`); the
device signs `register_statement(challenge, name, instance_id)` and sends the signature with its public
key in the REGISTER frame (`Registration.proof`, a `KeyProof`). The challenge is never reused, so a
recorded proof is worth nothing on another connection. At pairing the device signs
`claim_statement(code, fingerprint)` to claim its token.

Encodings: a public key is its 32 raw bytes, a signature its 64 raw bytes, both unpadded base64url;
a fingerprint is the SHA-256 of the raw public key, in hex. `cryptography` is imported on first use,
so modules that only carry the models do not pay for it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets

from pydantic import BaseModel, ConfigDict, Field

CHALLENGE_HEADER = "X-Tether-Challenge"
PUBLIC_KEY_CHARS = 43  # 32 bytes, unpadded base64url
SIGNATURE_CHARS = 86  # 64 bytes, unpadded base64url
_B64URL = r"^[A-Za-z0-9_-]+$"


class KeyProof(BaseModel):
    """Proof of possession of the device's key: its public key and a signature over the statement of
    the exchange it answers (`register_statement` at registration)."""

    model_config = ConfigDict(extra="forbid")

    public_key: str = Field(..., min_length=PUBLIC_KEY_CHARS, max_length=PUBLIC_KEY_CHARS, pattern=_B64URL,
                            description="the device's Ed25519 public key: 32 bytes, unpadded base64url")
    signature: str = Field(..., min_length=SIGNATURE_CHARS, max_length=SIGNATURE_CHARS, pattern=_B64URL,
                           description="Ed25519 signature of the statement: 64 bytes, unpadded base64url")


def b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def b64decode(text: str) -> bytes:
    """Unpadded (or padded) base64url; ValueError if it is not."""
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64url: {exc}") from None


def new_challenge() -> str:
    """A fresh registration challenge: 24 random bytes, base64url (32 characters)."""
    return secrets.token_urlsafe(24)


def fingerprint(public_key: str) -> str:
    """SHA-256 (hex) of the raw public key: what people compare (its first 16 digits are shown)."""
    return hashlib.sha256(b64decode(public_key)).hexdigest()


def register_statement(challenge: str, name: str | None, instance_id: str) -> bytes:
    """What a device signs to register: the server's challenge for this connection, the name it claims
    (empty when it claims none) and its instance id, so the proof fits this one registration only."""
    return f"tether-aip-register/1\n{challenge}\n{name or ''}\n{instance_id}".encode()


def claim_statement(code: str, fingerprint_hex: str) -> bytes:
    """What a pairing device signs to claim its token: its pairing code and its key's fingerprint."""
    return f"tether-pairing-claim/1\n{code}\n{fingerprint_hex}".encode()


def verify(public_key: str, signature: str, statement: bytes) -> bool:
    """True when `signature` is the Ed25519 signature of `statement` by `public_key`; False for a wrong
    signature, a malformed key or a malformed signature (never raises for what a peer sent)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = Ed25519PublicKey.from_public_bytes(b64decode(public_key))
        key.verify(b64decode(signature), statement)
    except (InvalidSignature, ValueError):
        return False
    return True


def valid_public_key(public_key: str) -> bool:
    """True when `public_key` decodes to an Ed25519 public key."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(b64decode(public_key))
    except ValueError:
        return False
    return True
