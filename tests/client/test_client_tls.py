"""`tether.Client` / `tether.AsyncClient` over HTTPS: a CA file, a pinned certificate, and a wrong pin refused
before anything is sent."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kits import db as dbkit
from tests.kits.netutil import Proc, free_port, tether_env, wait_for
from tether import AsyncClient, Client
from tether.client import ConnectError
from tether.device.link.trust.tls_pin import cert_fingerprint


@pytest.fixture
def https_server(tmp_path: Path, pki: dict[str, Path]) -> Iterator[dict[str, Any]]:
    state = tmp_path / "state"
    state.mkdir()
    db = state / "server.db"
    [token] = dbkit.create_tokens(dbkit.server_db(db), [("api", "ops", ["read"])])
    port = free_port()
    server = Proc(["server", "--port", str(port), *dbkit.server_db_args(db), "--tls-cert", str(pki["cert"]),
                   "--tls-key", str(pki["key"]), "--log-level", "warning"], tmp_path / "server.log", tether_env(state))
    url = f"https://127.0.0.1:{port}"
    with Client(url, token, verify=str(pki["ca"]), timeout=5) as probe:
        wait_for(lambda: probe.health()["status"] == "ok", "https health", procs=(server.popen,))
    yield {"url": url, "token": token, "ca": pki["ca"],
           "fingerprint": cert_fingerprint(ssl.PEM_cert_to_DER_cert(pki["cert"].read_text()))}
    server.stop()


async def test_ca_file_pin_and_wrong_pin(https_server: dict[str, Any]) -> None:
    s = https_server
    with Client(s["url"], s["token"], verify=str(s["ca"])) as by_ca:
        assert by_ca.devices() == []
    with Client(s["url"], s["token"], pin=s["fingerprint"]) as pinned:  # no CA: the pin alone is trusted
        assert pinned.health()["status"] == "ok"
    async with AsyncClient(s["url"], s["token"], pin=s["fingerprint"]) as pinned_async:
        assert (await pinned_async.health())["status"] == "ok"
    with Client(s["url"], s["token"], pin="00" * 32) as wrong, pytest.raises(ConnectError, match="pinned"):
        wrong.health()
    with Client(s["url"], s["token"]) as untrusted, pytest.raises(ConnectError):  # the system's CAs: unknown
        untrusted.health()
