"""A device is its key, not its token (issue 27): attacks on a device's identity, as an attacker tries them.

Real `tether server` and `tether device` processes on 127.0.0.1 (tests/kits/netutil.py), plus a scripted AIP
client (tests/kits/aip.py) where the attacker writes the frames itself:
- a device token read off one device (its sandbox, a backup) and used from another process and state
  directory: refused without the device's key, accepted with it (the key is the identity);
- a recorded key proof replayed on another connection: refused (each connection has its own challenge);
- a pairing request that names an existing device: marked in `tether devices pending`, refused at approval
  unless the admin chooses replace; with replace, the old device's credentials stop working;
- `tether token rotate`: the old token (and with a new key, the old key) stop working.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess

import pytest

from tests.kits import db as dbkit
from tests.kits.aip import FakeDevice, key_for
from tests.kits.netutil import CLI, Cluster, Proc, wait_for
from tether.device.link.trust.device_key import DeviceKey, load_device_key
from tether.protocol.messages import ServerMessageType

CODE = re.compile(r"pairing code: ([0-9A-Z]{4}-[0-9A-Z]{4})")
REFUSED_EXIT = 3  # `tether device` after a refusal that retrying cannot fix


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def admin(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args, "--server", f"http://127.0.0.1:{cluster.port}", "--token", cluster.api_token],
                          capture_output=True, text=True, env=cluster.env, timeout=60)


def on_server_db(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    """A `tether token …` command run beside the server, on its database (as an operator would)."""
    return subprocess.run([*CLI, *args, *dbkit.server_db_args(cluster.db)], capture_output=True, text=True,
                          env=cluster.env, timeout=60)


def device_in(cluster: Cluster, name: str, state: str, token: str | None) -> Proc:
    """`tether device` as `name` with the state directory `state` (its key lives there)."""
    args = ["device", "--server", f"ws://127.0.0.1:{cluster.port}", "--name", name,
            "--state-dir", str(cluster.state / state)]
    return cluster.start(args, f"{name}-{state}", {"TETHER_DEVICE_TOKEN": token} if token else None)


def refused(proc: Proc) -> str:
    """The device process gave up on a refusal; its output."""
    assert proc.popen.wait(timeout=60) == REFUSED_EXIT, proc.output()
    out = proc.output()
    assert "Traceback" not in out
    return out


def test_a_stolen_token_needs_the_device_key(cluster):
    token = cluster.device_tokens["alpha"]
    real = device_in(cluster, "alpha", "alpha-home", token)
    cluster.wait_online("alpha", real)
    key = load_device_key(cluster.state / "alpha-home" / "device.key", create=False)

    # the token, read from the device, used by another process with its own state directory: refused, and
    # the real device stays connected (no "duplicate" fight over the name, no replacement)
    thief = device_in(cluster, "alpha", "thief", token)
    out = refused(thief)
    assert "4402" in out and "enrolled with the key" in out and key.fingerprint[:16] in out
    assert cluster.status("alpha") in ("online", "busy") and real.popen.poll() is None

    # a thief who also copied the key file *is* the device: the key is the identity, not the token
    real.stop()
    wait_for(lambda: cluster.status("alpha") == "offline", "alpha offline", 30)
    shutil.copy2(cluster.state / "alpha-home" / "device.key", cluster.state / "thief" / "device.key")
    with_key = device_in(cluster, "alpha", "thief", token)
    cluster.wait_online("alpha", with_key)


def test_no_proof_or_a_replayed_proof_is_refused(cluster):
    url = f"ws://127.0.0.1:{cluster.port}/aip"
    token = cluster.device_tokens["beta"]

    async def attack() -> None:
        real = FakeDevice(url, token, name="beta")
        assert (await real.register()).type is ServerMessageType.REGISTER_ACK  # enrols key_for("beta")
        recorded = real.key.register_proof(real.challenge or "", "beta", real.instance_id)
        await real.close()

        bare = FakeDevice(url, token, name="beta", prove=False)  # the token alone, as before issue 27
        answer = await bare.register()
        assert answer.type is ServerMessageType.REGISTER_REFUSED and "did not prove its key" in (answer.error or "")
        assert (await bare.close_code())[0] == 4402

        # the real device's proof, recorded off a connection, sent again on a new one (same instance id,
        # even): it signs the old connection's challenge, not this one's
        replay = FakeDevice(url, token, name="beta", instance_id=real.instance_id)
        await replay.connect()
        assert replay.challenge and replay.challenge != real.challenge
        replay.challenge = real.challenge  # the attacker sends what it recorded
        answer = await replay.register()
        assert answer.type is ServerMessageType.REGISTER_REFUSED and "does not verify" in (answer.error or "")
        assert recorded.public_key == key_for("beta").public_key

        other = FakeDevice(url, token, name="beta", key=DeviceKey.generate())  # a key of its own: not beta's
        answer = await other.register()
        assert answer.type is ServerMessageType.REGISTER_REFUSED and "enrolled with the key" in (answer.error or "")

        again = FakeDevice(url, token, name="beta")  # the real key still works
        assert (await again.register()).type is ServerMessageType.REGISTER_ACK
        await again.close()

    asyncio.run(attack())


def pair(cluster: Cluster, name: str, state: str) -> tuple[Proc, str]:
    proc = cluster.start(["device", "--server", f"ws://127.0.0.1:{cluster.port}", "--pair", "--name", name,
                          "--state-dir", str(cluster.state / state)], f"pair-{state}")
    code = wait_for(lambda: CODE.search(proc.output()), f"{state}'s pairing code", 60, (proc.popen,)).group(1)
    return proc, code


def test_pairing_cannot_take_an_existing_name_without_replace(cluster):
    real = device_in(cluster, "alpha", "alpha-home", cluster.device_tokens["alpha"])
    cluster.wait_online("alpha", real)
    impostor, code = pair(cluster, "alpha", "impostor")

    # marked in the listing (JSON, table and the REST answer the dashboard reads)
    [row] = [r for r in json.loads(admin(cluster, "devices", "pending", "--json").stdout) if r["code"] == code]
    assert row["requested_name"] == "alpha" and "exists" in row["collision"]
    table = admin(cluster, "devices", "pending")
    assert "TAKEN" in table.stdout and "--replace" in table.stdout
    [rest] = [r for r in cluster.remote.pairing_requests() if r["code"] == code]
    assert rest["collision"]

    # approved as shown: refused, the name stays the real device's, nothing was handed out
    taken = admin(cluster, "devices", "approve", code)
    assert taken.returncode != 0 and "exists" in taken.stderr and "Traceback" not in taken.stderr
    assert impostor.popen.poll() is None and not (cluster.state / "impostor" / "device.token").exists()
    assert cluster.status("alpha") in ("online", "busy")
    # under a name of its own it is a new device; alpha is untouched
    done = admin(cluster, "devices", "approve", code, "--name", "alpha-2")
    assert done.returncode == 0, done.stderr
    cluster.wait_online("alpha-2", impostor)
    assert cluster.status("alpha") in ("online", "busy") and real.popen.poll() is None


def test_replace_revokes_the_old_identity(cluster):
    real = device_in(cluster, "alpha", "alpha-home", cluster.device_tokens["alpha"])
    cluster.wait_online("alpha", real)
    successor, code = pair(cluster, "alpha", "new-alpha")
    done = admin(cluster, "devices", "approve", code, "--replace")
    assert done.returncode == 0, done.stderr
    assert "replaces the previous alpha" in done.stdout
    # the old process is cut off at once (its token revoked) and refused when it comes back
    assert real.popen.wait(timeout=60) == REFUSED_EXIT, real.output()
    wait_for(lambda: "registered as alpha" in successor.output(), "the new alpha registers", 60, (successor.popen,))
    old = device_in(cluster, "alpha", "alpha-home", cluster.device_tokens["alpha"])
    assert "unknown or revoked" in refused(old)
    # even with a valid token of the new identity, the old machine's key is not alpha any more
    new_token = (cluster.state / "new-alpha" / "device.token").read_text().strip()
    assert "enrolled with the key" in refused(device_in(cluster, "alpha", "alpha-home", new_token))


def test_rotate_stops_the_old_credentials(cluster):
    old_token = cluster.device_tokens["alpha"]
    first = device_in(cluster, "alpha", "alpha-home", old_token)
    cluster.wait_online("alpha", first)

    rotated = on_server_db(cluster, "token", "rotate", "--device", "alpha", "--json")
    assert rotated.returncode == 0, rotated.stderr
    new_token = json.loads(rotated.stdout)["token"]
    assert json.loads(rotated.stdout)["revoked"] == 1
    assert first.popen.wait(timeout=60) == REFUSED_EXIT  # disconnected: its token was revoked
    assert "unknown or revoked" in refused(device_in(cluster, "alpha", "alpha-home", old_token))
    same_key = device_in(cluster, "alpha", "alpha-home", new_token)
    cluster.wait_online("alpha", same_key)
    same_key.stop()

    # a new key too: the device makes one, the admin enrols its public half with the rotation
    made = subprocess.run([*CLI, "device", "key", "--new", "--state-dir", str(cluster.state / "alpha-new"), "--json"],
                          capture_output=True, text=True, env=cluster.env, timeout=60)
    assert made.returncode == 0, made.stderr
    public = json.loads(made.stdout)["public_key"]
    rotated = on_server_db(cluster, "token", "rotate", "--device", "alpha", "--key", public, "--json")
    assert rotated.returncode == 0, rotated.stderr
    newest = json.loads(rotated.stdout)["token"]
    # the old key with the newest token: refused; the new key: accepted
    assert "enrolled with the key" in refused(device_in(cluster, "alpha", "alpha-home", newest))
    cluster.wait_online("alpha", device_in(cluster, "alpha", "alpha-new", newest))
