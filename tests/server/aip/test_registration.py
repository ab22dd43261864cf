"""The admission rules of server/aip/sockets/registration.py, judged without a socket: each bad handshake header or
first frame gets the close code and the reason the device is shown. tests/test_e2e.py and
tests/attacks/test_protocol_attacks.py send the same through a real server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tether.protocol.codec import encode
from tether.protocol.messages import ClientMessage, ClientMessageType, Registration
from tether.protocol.profile import DeviceProfile
from tether.protocol.wire import CloseCode
from tether.server.aip.sockets.registration import authenticate, read_registration
from tether.server.aip.sockets.socket import Refusal
from tether.server.store import Store
from tether.server.store.tokens import TokenInfo


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(str(tmp_path / "server.db"))


def test_only_a_live_device_token_in_a_bearer_header_authenticates(store: Store) -> None:
    _, device = store.tokens.create("device", "laptop")
    _, api = store.tokens.create("api", "ops", ["read"])
    _, revoked = store.tokens.create("device", "old")
    store.tokens.revoke("old")
    info = asyncio.run(authenticate(store, f"Bearer {device}"))
    assert isinstance(info, TokenInfo) and info.name == "laptop" and info.kind == "device"
    for header, why in [(None, "no token"), ("", "no token"), (f"Basic {device}", "must be 'Bearer"),
                        ("Bearer   ", "must be 'Bearer"), ("Bearer tdev_made_up", "unknown or revoked"),
                        (f"Bearer {revoked}", "unknown or revoked"), (f"Bearer {api}", "an API token cannot")]:
        verdict = asyncio.run(authenticate(store, header))
        assert isinstance(verdict, Refusal) and verdict.code == CloseCode.UNAUTHORIZED and why in verdict.error, header


def _register(name: str | None) -> str:
    reg = Registration(name=name, instance_id="i-1", profile=DeviceProfile())
    return encode(ClientMessage(type=ClientMessageType.REGISTER, payload=reg.model_dump()))


def test_the_first_frame_must_register_the_tokens_own_device() -> None:
    reg = read_registration(_register("laptop"), "laptop", 1 << 20)
    assert isinstance(reg, Registration) and reg.instance_id == "i-1"
    assert isinstance(read_registration(_register(None), "laptop", 1 << 20), Registration)  # no claim: the token's
    cases = [
        (_register("desktop"), CloseCode.WRONG_DEVICE, "belongs to device 'laptop'"),
        ("not json", CloseCode.BAD_REGISTRATION, "registration refused"),
        (encode(ClientMessage(type=ClientMessageType.HEARTBEAT)), CloseCode.BAD_REGISTRATION, "must be a register"),
        (encode(ClientMessage(type=ClientMessageType.REGISTER, payload={"instance_id": 5})), CloseCode.BAD_REGISTRATION,
         "invalid registration"),
        (_register("laptop"), CloseCode.BAD_REGISTRATION, "registration refused"),  # over a 64-byte frame limit
    ]
    for i, (frame, code, why) in enumerate(cases):
        verdict = read_registration(frame, "laptop", 64 if i == len(cases) - 1 else 1 << 20)
        assert isinstance(verdict, Refusal) and verdict.code == code and why in verdict.error, (frame[:80], verdict)
