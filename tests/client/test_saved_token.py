"""`Client` and `AsyncClient` find a token as the CLI does when none is given: $TETHER_TOKEN, else the one
`tether token create --admin` saved (here through $TETHER_TOKEN_FILE), against a real server that needs one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.kits.task import AgentServer
from tether import AsyncClient, Client
from tether.client import HTTPStatusError


async def test_a_client_without_a_token_uses_the_saved_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = tmp_path / "config" / "token"
    monkeypatch.setenv("TETHER_TOKEN_FILE", str(saved))
    monkeypatch.delenv("TETHER_TOKEN", raising=False)
    async with AgentServer(tmp_path) as server:
        base = f"http://127.0.0.1:{server.port}"
        async with AsyncClient(base) as nobody:  # no file yet: no token sent, refused
            with pytest.raises(HTTPStatusError) as refused:
                await nobody.devices()
            assert refused.value.status == 401
        saved.parent.mkdir()
        saved.write_text(server.token + "\n")
        saved.chmod(0o600)
        async with AsyncClient(base) as client:
            assert await client.devices() == []
        with Client(base) as client:  # the synchronous one alike (off the loop: it blocks)
            assert await asyncio.to_thread(client.devices) == []
        monkeypatch.setenv("TETHER_TOKEN", "not-a-token")  # the environment comes before the file, as in the CLI
        async with AsyncClient(base) as client:
            with pytest.raises(HTTPStatusError) as refused:
                await client.devices()
            assert refused.value.status == 401
        async with AsyncClient(base, server.token) as client:  # a token given comes first of all
            assert await client.devices() == []
