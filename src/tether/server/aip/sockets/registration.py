"""The rules of a device's admission, apart from the hub's state: whose token this is, whether the first
frame is a registration of that device, whether it proves that device's key (`prove_key`: a token alone
is a bearer secret, the key is the device), and how a refusal is said.

Each is a judgement on what the device sent, so each answers a verdict instead of raising: a `TokenInfo`
or a `Registration`, else a `Refusal` with the close code and the reason the device is shown. The hub
(`server/aip/hub.py`) applies them, and decides what registering changes: the connection it replaces, the
batches it resumes or fails.
"""

from __future__ import annotations

import logging

from tether.protocol.codec import encode
from tether.protocol.identity import fingerprint, register_statement, verify
from tether.protocol.messages import Registration, ServerMessage, ServerMessageType, TaskStatus
from tether.protocol.server_session import RegistrationRefused, ServerSession
from tether.protocol.wire import CloseCode
from tether.server.aip.sockets.link import close_socket
from tether.server.aip.sockets.socket import AIPSocket, Refusal, SocketClosed
from tether.server.store import Store
from tether.server.store.tokens import TokenInfo
from tether.server.trust.device_keys import FIRST_REGISTRATION, device_key, enroll_first

logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name


async def authenticate(store: Store, authorization: str | None) -> TokenInfo | Refusal:
    """The device token's info, or why the connection is unauthorized (looked up without holding up the
    event loop: `Tokens.check`)."""
    def refused(error: str) -> Refusal:
        return Refusal(CloseCode.UNAUTHORIZED, error)

    if not authorization:
        return refused("unauthorized: no token; send the header 'Authorization: Bearer <device token>'")
    scheme, _, secret = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        return refused("unauthorized: the Authorization header must be 'Bearer <device token>'")
    info = await store.tokens.check(secret.strip())
    if info is None:
        return refused("unauthorized: unknown or revoked device token")
    if info.kind != "device":
        return refused("unauthorized: an API token cannot register a device; use 'tether token create --device NAME'")
    return info


def read_registration(frame: str, device: str, max_frame_bytes: int) -> Registration | Refusal:
    """The REGISTER of the device whose token is `device`, from the connection's first frame
    (`protocol.server_session.ServerSession.register`), or the refusal with its close code."""
    reg = ServerSession(device, max_frame_bytes).register(frame)
    return refusal_of(reg) if isinstance(reg, RegistrationRefused) else reg


def refusal_of(refused: RegistrationRefused) -> Refusal:
    """The refusal (close code and reason) for a first frame the session refused."""
    return Refusal(refused.code, refused.error)


def prove_key(store: Store, device: str, reg: Registration, challenge: str | None) -> Refusal | None:
    """None when the registration proves the key enrolled for `device` (the token's), else the refusal.

    The proof is a signature of `identity.register_statement` for this connection's `challenge`, so it
    fits no other connection. A device with no key enrolled yet (its token was made without one) enrols
    the key it proves now, once: from then on that key is the device. A token alone is never enough.
    """
    def refused(error: str) -> Refusal:
        return Refusal(CloseCode.KEY_REFUSED, error)

    proof = reg.proof
    if challenge is None:
        return refused("unauthorized: this connection was given no key challenge; connect through the /aip endpoint")
    if proof is None:
        return refused(f"unauthorized: device '{device}' did not prove its key: a device token alone is not "
                       "the device (upgrade the device; it signs the server's challenge with the key in its "
                       "state directory)")
    enrolled = device_key(store, device)
    if enrolled is not None and enrolled.public_key != proof.public_key:
        return refused(f"unauthorized: device '{device}' is enrolled with the key "
                       f"{fingerprint(enrolled.public_key)[:16]}, not {fingerprint(proof.public_key)[:16]}: "
                       "this token is being used by another machine, or "
                       f"the device's key changed (an admin can re-enrol it: tether token rotate --device {device} "
                       "--key PUBLIC_KEY)")
    if not verify(proof.public_key, proof.signature, register_statement(challenge, reg.name, reg.instance_id)):
        return refused(f"unauthorized: the key proof of device '{device}' does not verify (a signature for "
                       "another challenge, name or instance)")
    if enrolled is None and enroll_first(store, device, proof.public_key, FIRST_REGISTRATION) != proof.public_key:
        return refused(f"unauthorized: another key was enrolled for device '{device}' meanwhile")
    return None


async def refuse(socket: AIPSocket, refusal: Refusal, peer: str | None) -> None:
    """Tell the device why (a REGISTER_REFUSED frame), then close with the refusal's code."""
    logger.warning("refused device connection from %s (%d): %s", peer, refusal.code, refusal.error)
    try:
        await socket.send_text(encode(ServerMessage(type=ServerMessageType.REGISTER_REFUSED,
                                                    status=TaskStatus.ERROR, error=refusal.error)))
    except SocketClosed:
        pass
    await close_socket(socket, refusal.code, refusal.error)
