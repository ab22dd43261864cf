"""The device's own key: an Ed25519 private key kept in its state directory, proving who it is.

`load_device_key(path)` reads the key (PKCS#8 PEM, mode 0600 in a 0700 directory), making it on first
use. The state directory is hidden from every sandboxed tool, like the token file, so nothing a device
runs for an agent can read it; a key file named elsewhere (`server.key_file` in the config) is hidden
the same way (the CLI adds it to the sandbox's hidden paths). The key never leaves the device: the server
only ever sees its public half and signatures (`tether.protocol.identity`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tether.protocol.identity import KeyProof, b64encode, fingerprint, register_statement

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

logger = logging.getLogger("tether.device.link.device_key")  # the name operators filter on

KEY_FILE = "device.key"


class DeviceKey:
    """An Ed25519 private key and what the device does with it: show its public key, sign."""

    def __init__(self, private: Ed25519PrivateKey, path: Path | None = None) -> None:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self._private = private
        self.path = path  # where it is kept; None for a key that lives only in memory
        self.public_key = b64encode(private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))
        self.fingerprint = fingerprint(self.public_key)

    @classmethod
    def generate(cls) -> DeviceKey:
        """A new key, in memory only (tests, benchmarks, a connection given no key)."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return cls(Ed25519PrivateKey.generate())

    def sign(self, statement: bytes) -> str:
        """The signature of `statement`, unpadded base64url."""
        return b64encode(self._private.sign(statement))

    def register_proof(self, challenge: str, name: str | None, instance_id: str) -> KeyProof:
        """The proof a REGISTER carries for the connection that was given `challenge`."""
        return KeyProof(public_key=self.public_key,
                        signature=self.sign(register_statement(challenge, name, instance_id)))

    def pem(self) -> bytes:
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        return self._private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_device_key(path: Path, *, create: bool = True) -> DeviceKey:
    """The device's key kept at `path`; with `create`, a new one is made there (0600) when the file is
    missing or holds no Ed25519 key (an older tether kept a random pairing secret under the same name:
    it served only the pairing claim, which is over). ValueError when it cannot be read or made."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = None
    except OSError as exc:
        raise ValueError(f"cannot read the device key {path}: {exc.strerror or exc}") from None
    if data is not None:
        try:
            private = load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            private = None
        if isinstance(private, Ed25519PrivateKey):
            return DeviceKey(private, path)
        if not create:
            raise ValueError(f"{path} holds no Ed25519 private key")
        logger.warning("%s holds no Ed25519 key (an older tether's pairing secret?): making a new device key", path)
    elif not create:
        raise ValueError(f"no device key at {path}")
    return new_device_key(path)


def new_device_key(path: Path) -> DeviceKey:
    """Replace the key at `path` with a new one (the old one is gone: the server must be told the new
    public key, `tether token rotate --device NAME --key PUBLIC_KEY`, or the device is refused)."""
    key = DeviceKey.generate()
    try:
        _write_private(path, key.pem())
    except OSError as exc:
        raise ValueError(f"cannot write the device key {path}: {exc.strerror or exc}") from None
    key.path = path
    return key
