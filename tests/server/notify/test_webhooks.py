"""Webhooks and the approval inbox (docs/approvals.md), with the whole agent server under uvicorn, a real
device, the `tether` CLI as a subprocess and a real HTTP receiver on 127.0.0.1.

Each event (approval needed, task finished, task failed, device offline) reaches the receiver signed with
the webhook's secret; a 500 is retried and the delivery's record says so; a private address is refused
unless the server's setting allows it; the inbox lists what waits and `tether approvals approve` answers it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.kits import db as dbkit
from tests.kits.netutil import CLI
from tests.kits.task import WAIT, AgentServer
from tether.server.notify.notifier import Notifier
from tether.server.notify.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify
from tether.server.settings import ServerSettings
from tether.server.store import Store
from tether.tools.policy.model import default_policy


class Receiver:
    """An HTTP server that records every POST and answers with the next of `statuses` (then 200)."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.got: asyncio.Queue[tuple[dict[str, str], bytes]] = asyncio.Queue()
        self.answered: list[int] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status = self.statuses.pop(0) if self.statuses else 200
        self.answered.append(status)
        await self.got.put(({k.decode().lower(): v.decode() for k, v in scope["headers"]}, body))
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def next_event(self, event: str) -> tuple[dict[str, str], bytes]:
        """The next delivery of `event` (others skipped), bounded by WAIT."""
        async with asyncio.timeout(WAIT):
            while True:
                headers, body = await self.got.get()
                if headers.get("x-tether-event") == event:
                    return headers, body


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    app = Receiver([500])  # the first delivery fails: it must be retried
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_config=None, log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield app, f"http://127.0.0.1:{sock.getsockname()[1]}/hooks/secret-path"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT)


def signed(secret: str, headers: dict[str, str], body: bytes) -> bool:
    return verify(secret, headers.get(TIMESTAMP_HEADER.lower()), headers.get(SIGNATURE_HEADER.lower()), body)


def cli(*args: str, server: AgentServer, token: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TETHER_SERVER": f"http://127.0.0.1:{server.port}", "TETHER_TOKEN": token,
           "COLUMNS": "80", "NO_COLOR": "1"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=60, check=False)


async def test_every_event_reaches_a_local_webhook_signed_and_the_inbox_answers(
        tmp_path: Path, receiver: tuple[Receiver, str]) -> None:
    got, url = receiver
    root = tmp_path / "alpha"
    root.mkdir()
    policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
    async with AgentServer(tmp_path, webhook_allow_private=True, webhook_retry_s=0.05) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        added = await server.api.post("/webhooks", json={"url": url})
        assert added.status_code == 201, added.text
        hook = added.json()
        secret = hook["secret"]
        assert hook["url"] == url.rsplit("/", 2)[0] + "/hooks/…"  # the path after its first segment is hidden
        listed = (await server.api.get("/webhooks")).json()
        assert listed == [{k: v for k, v in hook.items() if k != "secret"}] and "secret-path" not in str(listed)

        # a plan to confirm: approval.needed, in the inbox of the server's person token
        _, careful = server.store.tokens.create("api", "careful", ["read", "execute"], confirm="always")
        target = root / "made.txt"
        created = (await server.api.post("/tasks", json={"device": "alpha", "plan": [
            {"skill": "write_file", "args": {"file_path": str(target), "content": "x"}}]},
            headers={"Authorization": f"Bearer {careful}"})).json()
        headers, body = await got.next_event("approval.needed")
        assert signed(secret, headers, body)
        assert not signed("whsec_another-secret-entirely", headers, body)
        message = json.loads(body)
        assert message["event"] == "approval.needed" and message["data"]["task"] == created["id"]
        assert got.answered[0] == 500  # the first try failed, and this is the retry
        inbox = (await server.api.get("/approvals")).json()
        assert [(i["id"], i["kind"], i["device"]) for i in inbox] == [(created["id"], "confirmation", "alpha")]
        assert (await server.api.get("/approvals", headers={"Authorization": f"Bearer {careful}"})).json() == []
        shown = await asyncio.to_thread(cli, "approvals", server=server, token=server.token)
        assert shown.returncode == 3, shown.stderr  # something waits for a person
        assert created["id"][:12] in shown.stdout and "confirmation" in shown.stdout
        approved = await asyncio.to_thread(cli, "approvals", "approve", created["id"][:8], server=server,
                                           token=server.token)
        assert approved.returncode == 0, approved.stderr
        headers, body = await got.next_event("task.finished")
        assert signed(secret, headers, body) and json.loads(body)["data"]["task"] == created["id"]
        assert target.read_text() == "x"
        # one sender sends a batch and records it before the next: this later delivery proves the first recorded
        deliveries = (await server.api.get(f"/webhooks/{hook['id']}/deliveries")).json()
        first = next(d for d in deliveries if d["event"] == "approval.needed")
        assert first["status"] == "delivered" and first["attempts"] == 2 and first["last_status"] == 200
        assert "secret-path" not in json.dumps(deliveries)
        empty = await asyncio.to_thread(cli, "approvals", server=server, token=server.token)
        assert empty.returncode == 0 and "nothing waits" in empty.stdout

        failing = await server.create(device="alpha", plan=[{"skill": "teleport", "args": {}}])
        headers, body = await got.next_event("task.failed")
        assert signed(secret, headers, body) and json.loads(body)["data"]["task"] == failing["id"]

        await server.drop_device("alpha")
        headers, body = await got.next_event("device.offline")
        assert signed(secret, headers, body) and json.loads(body)["data"]["device"] == "alpha"


async def test_private_addresses_and_other_schemes_are_refused(tmp_path: Path) -> None:
    async with AgentServer(tmp_path) as server:
        for url in ("http://127.0.0.1:9/x", "http://10.1.2.3/x", "http://[::1]/x", "http://169.254.169.254/latest",
                    "http://localhost:8080/", "http://100.64.0.1/x"):
            refused = await server.api.post("/webhooks", json={"url": url})
            assert refused.status_code == 403, (url, refused.text)  # the server's settings forbid it
            assert "webhook_allow_private" in refused.json()["error"], refused.text
        for url in ("ftp://example.com/x", "file:///etc/passwd", "http://user:pw@example.com/"):
            refused = await server.api.post("/webhooks", json={"url": url})
            assert refused.status_code == 400 and "error" in refused.json(), (url, refused.text)
        wide = await server.api.post("/webhooks", json={"url": "https://example.com/x", "server_wide": True})
        assert wide.status_code == 403  # the server's own webhooks take an admin token
        assert (await server.api.get("/webhooks")).json() == []


async def test_a_delivery_recorded_before_a_restart_is_sent_after_it(tmp_path: Path,
                                                                     receiver: tuple[Receiver, str]) -> None:
    """A server that recorded a delivery and stopped before sending it (the notifier never started): the next
    server on the same database sends it, retrying the receiver's first 500."""
    got, url = receiver
    db = tmp_path / "server.db"
    store = Store(dbkit.server_db(db))
    secret = "whsec_" + "k" * 24
    store.webhooks.add("wh_restart", url, secret, ["device.offline"], "slack", None, "api")
    settings = ServerSettings(**dbkit.settings_db(db), webhook_allow_private=True)
    made = Notifier(store, settings).emit("device.offline", "Device <lab> went offline", {"Device": "<lab>"},
                                          devices=[("lab", ())])
    store.close()  # with PostgreSQL the delivery is recorded behind the caller (emit: None), before the close
    assert made == (None if store.calls is not None else 1)
    async with AgentServer(tmp_path, db_path=db, webhook_allow_private=True, webhook_retry_s=0.05):
        await got.next_event("device.offline")  # answered 500: retried
        headers, body = await got.next_event("device.offline")
    assert signed(secret, headers, body) and got.answered[:2] == [500, 200]
    slack = json.loads(body)
    assert set(slack) == {"text", "blocks"} and slack["text"] == "Device &lt;lab&gt; went offline"  # escaped


async def test_a_pinned_client_connects_to_the_checked_address_with_the_url_s_host(
        receiver: tuple[Receiver, str]) -> None:
    """`pinned_client` reaches the address it was given for a name that resolves nowhere, with the URL's
    Host; any other host is refused rather than looked up."""
    from tether.server.notify.pinning import pinned_client

    got, url = receiver
    port = url.split(":")[2].split("/")[0]
    named = f"http://hooks.rebind.invalid:{port}/hooks/x"  # .invalid never resolves: no lookup happened
    async with pinned_client(named, "127.0.0.1", WAIT) as client:
        answer = await client.post(named, content=b"{}")
        async with asyncio.timeout(WAIT):
            headers, _ = await got.got.get()
        assert answer.status_code in (200, 500) and headers["host"] == f"hooks.rebind.invalid:{port}"
        with pytest.raises(httpx.ConnectError, match="its own host only"):
            await client.post(f"http://elsewhere.invalid:{port}/", content=b"{}")


async def test_a_name_that_rebinds_to_loopback_after_the_check_is_never_reached(
        tmp_path: Path, receiver: tuple[Receiver, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An attacker's name answers a public address to the checks (when the webhook is added, and before the
    send) and 127.0.0.1 to any later lookup, as a DNS-rebinding server would. The send connects to the address
    it checked: the loopback receiver gets nothing, and the name is looked up no third time."""
    got, url = receiver
    port = int(url.split(":")[2].split("/")[0])
    lookups: list[str] = []
    real = socket.getaddrinfo

    def rebinding(host: Any, *args: Any, **kwargs: Any) -> Any:
        if (host.decode() if isinstance(host, bytes) else host) != "hooks.rebind.example":  # anyio sends bytes
            return real(host, *args, **kwargs)
        lookups.append("hooks.rebind.example")
        address = "1.1.1.1" if len(lookups) <= 2 else "127.0.0.1"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    async with AgentServer(tmp_path, webhook_timeout=2.0, webhook_attempts=1) as server:
        added = await server.api.post("/webhooks", json={"url": f"http://hooks.rebind.example:{port}/hooks/x"})
        assert added.status_code == 201, added.text  # public when added
        hook = added.json()["id"]
        assert (await server.api.post(f"/webhooks/{hook}/test")).status_code == 202
        async with asyncio.timeout(WAIT):  # bounded: the attempt ends in webhook_timeout at most
            while not (rows := (await server.api.get(f"/webhooks/{hook}/deliveries")).json()) \
                    or rows[0]["status"] == "pending":
                await asyncio.sleep(0.05)
    assert rows[0]["status"] == "failed" and rows[0]["last_status"] is None, rows
    assert lookups == ["hooks.rebind.example"] * 2  # the check when added, the check before the send: no third
    assert got.got.empty() and got.answered == []  # the loopback receiver was never reached
