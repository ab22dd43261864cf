"""The device's state directory — its undo journal, the token pairing gave it, its pairing key and the
server's policy changes — is out of reach of everything the device runs, tried as an agent would:
the file tools cannot read or write it, and a process cannot see it, copy it out, or plant a file
in it. The state directory here lies inside a write root (the test's directory in the temp dir, named as a
root of its own: the machine's, not a session's private /tmp), as ~/.local/state lies inside ~ on a real
machine."""

from __future__ import annotations

import json
import tempfile

import pytest

from tests.kits.netutil import Cluster
from tether.protocol.models import Command


@pytest.fixture
def device(tmp_path):
    cluster = Cluster(tmp_path)
    state = cluster.state / "dev-alpha"
    state.mkdir(parents=True)
    (state / "device.token").write_text("tdev_paired_secret\n")
    (state / "device.key").write_text("pairing-key-material\n")
    (state / "remote-policy.json").write_text(json.dumps({"version": 1, "overlay": {}}))
    # the test's directory (the state directory's, in the temp dir) is a write root of its own: the machine's,
    # as ~ is, not the session's private /tmp (in which the machine's state directory is not there at all)
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"write_roots": ["~", tempfile.gettempdir(), str(tmp_path)]}))
    proc = cluster.device("alpha", extra=("--policy", str(policy)))
    cluster.wait_online("alpha", proc)
    yield cluster, state
    cluster.close()


def run(cluster: Cluster, tool: str, **args):
    _, [result] = cluster.remote.run("alpha", [Command(tool_name=tool, parameters=args)], timeout=60)
    return result


@pytest.mark.parametrize("name", ["device.token", "device.key", "remote-policy.json"])
def test_file_tools_cannot_read_it(device, name):
    cluster, state = device
    result = run(cluster, "read_file", file_path=str(state / name))
    assert not result.ok and "state directory" in result.error
    assert "tdev_paired_secret" not in json.dumps(result.model_dump())


def test_file_tools_cannot_plant_a_policy_or_replace_the_token(device):
    cluster, state = device
    before = {p.name: p.read_bytes() for p in state.iterdir() if p.is_file()}
    for target, content in (("remote-policy.json", '{"version": 99, "overlay": {"allow_all": true}}'),
                            ("device.token", "tdev_attacker")):
        result = run(cluster, "write_file", file_path=str(state / target), content=content)
        assert not result.ok and "state directory" in result.error
    moved = run(cluster, "move_file", source=str(state), destination=str(cluster.tmp / "stolen"))
    assert not moved.ok
    assert {p.name: p.read_bytes() for p in state.iterdir() if p.is_file() and p.name in before} == before


def test_processes_cannot_see_or_change_it(device):
    cluster, state = device
    seen = run(cluster, "shell.run", cmd="cat", argv=[str(state / "device.token")], cwd=str(cluster.tmp))
    assert "tdev_paired_secret" not in json.dumps(seen.model_dump())
    assert "PRIVATE KEY" in (state / "device.key").read_text()  # the device's key (issue 27) ...
    seen = run(cluster, "shell.run", cmd="cat", argv=[str(state / "device.key")], cwd=str(cluster.tmp))
    assert "PRIVATE KEY" not in json.dumps(seen.model_dump())  # ... which nothing it runs can read
    run(cluster, "shell.run", cmd="cp", argv=["-r", str(state), str(cluster.tmp / "loot")],
                 cwd=str(cluster.tmp))
    assert not (cluster.tmp / "loot" / "device.token").exists() or \
        "tdev_paired_secret" not in (cluster.tmp / "loot" / "device.token").read_text()
    planted = run(cluster, "shell.run", cmd="cp", argv=[str(cluster.tmp / "server-0.log"),
                                                          str(state / "remote-policy.json")], cwd=str(cluster.tmp))
    assert json.loads((state / "remote-policy.json").read_text())["version"] == 1, planted
    assert (state / "device.token").read_text() == "tdev_paired_secret\n"
