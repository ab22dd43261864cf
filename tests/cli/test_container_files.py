"""The Dockerfile and compose.yaml, checked without Docker (CI has no daemon): every file they copy
exists, and every command they run is one the `tether` CLI accepts, option by option."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

from tests.kits.netutil import CLI

ROOT = Path(__file__).resolve().parents[2]


def accepted(argv: list[str]) -> None:
    """`tether ARGV --help` parses every option before printing help: an unknown one fails it."""
    done = subprocess.run([*CLI, *argv, "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, f"tether {' '.join(argv)}: {done.stderr}"


def instructions() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            found.setdefault(word.upper(), []).append(rest.strip())
    return found


def test_dockerfile_runs_the_server_as_a_user_with_a_state_volume():
    ins = instructions()
    assert ins["FROM"][0].startswith("debian:bookworm")  # Python 3.11, as the README promises
    for copy in ins["COPY"]:
        *sources, _ = copy.split()
        assert all((ROOT / s).exists() for s in sources), copy
    [entry], [cmd] = ins["ENTRYPOINT"], ins["CMD"]
    assert json.loads(entry) == ["tether"]
    accepted(json.loads(cmd))
    assert ins["USER"] == ["tether"] and "bubblewrap" in " ".join(ins["RUN"])
    assert any("TETHER_STATE_DIR=/var/lib/tether" in env for env in ins["ENV"])
    assert "8765" in ins["EXPOSE"][0]


def test_compose_has_a_server_and_a_pairing_device():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    server, device = compose["services"]["server"], compose["services"]["device"]
    assert server["build"] == "." and device["image"] == server["image"]
    accepted(server["command"])
    accepted(device["command"])
    assert "--pair" in device["command"] and "ws://server:8765" in device["command"]
    assert "--allowed-host" in server["command"]  # the device names the server "server" in its Host header
    assert all(p.startswith("127.0.0.1:") for p in server["ports"])  # not published beyond this machine
    assert "seccomp=unconfined" in device["security_opt"]  # bubblewrap needs user namespaces
    for service in (server, device):
        [volume] = service["volumes"]
        assert volume.split(":")[0] in compose["volumes"] and volume.endswith(":/var/lib/tether")
