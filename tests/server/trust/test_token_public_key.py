"""`POST /api/v1/tokens` enrols a device's public key with its token (issue 27, "a device is its key"):
an admin gives the key the device prints (`tether device key`, or PEM) when creating the token instead of
letting the first registration enrol whatever key it proves. A malformed key is a 400 `{"error"}`; a
device that has another key is a 409; and from then on a registration proving another key is refused
(close 4402) while the device holding the enrolled key registers. Real server and device processes."""

from __future__ import annotations

import asyncio
import base64
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.kits.aip import FakeDevice
from tests.kits.netutil import Cluster
from tether.device.link.trust.device_key import DeviceKey, load_device_key
from tether.protocol.identity import fingerprint
from tether.protocol.messages import ServerMessageType

REFUSED_EXIT = 3  # `tether device` after a refusal that retrying cannot fix


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()


def create(cluster: Cluster, **body: object) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{cluster.port}/api/v1/tokens", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {cluster.api_token}"})


def test_a_key_given_at_creation_is_the_device(cluster: Cluster) -> None:
    # the device's key, made where the device keeps it (as `tether device key` does on the device)
    key = load_device_key(cluster.state / "dev-gamma" / "device.key")
    made = create(cluster, kind="device", name="gamma", public_key=key.public_key)
    assert made.status_code == 201, made.text
    assert made.json()["info"]["key_fingerprint"] == key.fingerprint
    token = made.json()["token"]

    real = cluster.device("gamma", token=token)  # the real device, proving the enrolled key: online
    cluster.wait_online("gamma", real)

    # the token without that key (another process, its own state directory and key): refused with 4402
    thief = cluster.start(["device", "--server", f"ws://127.0.0.1:{cluster.port}", "--name", "gamma",
                           "--state-dir", str(cluster.state / "thief")], "thief", {"TETHER_DEVICE_TOKEN": token})
    assert thief.popen.wait(timeout=60) == REFUSED_EXIT, thief.output()
    assert "4402" in thief.output() and "enrolled with the key" in thief.output()
    assert cluster.status("gamma") in ("online", "busy") and real.popen.poll() is None

    async def other_key() -> None:  # a raw connection too: the close code itself
        other = FakeDevice(f"ws://127.0.0.1:{cluster.port}/aip", token, name="gamma", key=DeviceKey.generate())
        answer = await other.register()
        assert answer.type is ServerMessageType.REGISTER_REFUSED and "enrolled with the key" in (answer.error or "")
        assert (await other.close_code())[0] == 4402

    asyncio.run(other_key())


def test_pem_and_padded_base64_are_read_as_the_same_key(cluster: Cluster) -> None:
    private = Ed25519PrivateKey.generate()
    public = private.public_key()
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    made = create(cluster, kind="device", name="delta", public_key=pem)
    assert made.status_code == 201, made.text
    expected = fingerprint(base64.urlsafe_b64encode(raw).rstrip(b"=").decode())
    assert made.json()["info"]["key_fingerprint"] == expected
    again = create(cluster, kind="device", name="delta", public_key=base64.b64encode(raw).decode())
    assert again.status_code == 201, again.text  # the same key, another spelling: a second token for it
    assert again.json()["info"]["key_fingerprint"] == expected

    async def register() -> None:
        device = FakeDevice(f"ws://127.0.0.1:{cluster.port}/aip", again.json()["token"], name="delta",
                            key=DeviceKey(private))
        assert (await device.register()).type is ServerMessageType.REGISTER_ACK
        await device.close()

    asyncio.run(register())


def test_a_malformed_or_foreign_key_is_refused(cluster: Cluster) -> None:
    rsa = subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:1024"],
                         capture_output=True, text=True, check=False)
    private_pem = DeviceKey.generate().pem().decode()
    for bad in ("not-a-key", "A" * 43 + "!", base64.b64encode(b"\x00" * 31).decode(), private_pem, ""):
        refused = create(cluster, kind="device", name="eps", public_key=bad)
        assert refused.status_code in (400, 422) and set(refused.json()) == {"error"}, (bad, refused.text)
    if rsa.returncode == 0:
        public_rsa = subprocess.run(["openssl", "pkey", "-pubout"], input=rsa.stdout, capture_output=True,
                                    text=True, check=True).stdout
        refused = create(cluster, kind="device", name="eps", public_key=public_rsa)
        assert refused.status_code == 400 and "Ed25519" in refused.json()["error"], refused.text
    api = create(cluster, kind="api", name="eps-api", scopes=["read"], public_key=DeviceKey.generate().public_key)
    assert api.status_code in (400, 422) and "error" in api.json(), api.text
    # nothing was made for the refused requests
    listed = httpx.get(f"http://127.0.0.1:{cluster.port}/api/v1/tokens", timeout=30,
                       headers={"Authorization": f"Bearer {cluster.api_token}"}).json()
    assert not [t for t in listed if t["name"] in ("eps", "eps-api")]


def test_a_device_with_another_key_keeps_it(cluster: Cluster) -> None:
    first = DeviceKey.generate()
    assert create(cluster, kind="device", name="zeta", public_key=first.public_key).status_code == 201
    other = create(cluster, kind="device", name="zeta", public_key=DeviceKey.generate().public_key)
    assert other.status_code == 409 and "rotate" in other.json()["error"], other.text
    same = create(cluster, kind="device", name="zeta", public_key=first.public_key)
    assert same.status_code == 201 and same.json()["info"]["key_fingerprint"] == first.fingerprint
