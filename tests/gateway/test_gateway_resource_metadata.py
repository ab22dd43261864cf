"""`/mcp` as an OAuth protected resource (RFC 9728): its Protected Resource Metadata at both well-known URLs,
the `resource_metadata` pointer on every 401, and the official `mcp` Python SDK's OAuth discovery
(`mcp.client.auth`) and the official TypeScript SDK's (`client/auth`, tests/gateway/node/auth_discovery.cjs)
finding and accepting that document."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest

from tests.kits.aip import WAIT
from tests.kits.gateway import GatewayServer
from tether.server.store.tokens import SCOPES

INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "curl", "version": "1"}}}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
ISSUER = "https://issuer.example.com/realms/fleet"
NODE_MODULES = Path(__file__).resolve().parents[2] / ".tether-test-node" / "node_modules"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[GatewayServer]:
    running = await GatewayServer(tmp_path).start()
    yield running
    await running.stop()


async def test_the_metadata_names_mcp_its_scopes_and_no_authorization_server(server: GatewayServer) -> None:
    async with httpx2.AsyncClient(timeout=WAIT) as http:
        suffixed = await http.get(f"{server.base}/.well-known/oauth-protected-resource/mcp")
        root = await http.get(f"{server.base}/.well-known/oauth-protected-resource")
        posted = await http.post(f"{server.base}/.well-known/oauth-protected-resource/mcp", json={})
    for response in (suffixed, root):
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("application/json")
        document = response.json()
        assert document["resource"] == server.mcp_url  # the URL the client dialed, exactly (RFC 9728 §3.3)
        assert document["bearer_methods_supported"] == ["header"]
        assert document["scopes_supported"] == list(SCOPES) and document["resource_name"]
        assert "authorization_servers" not in document  # tether's own tokens need none
    assert posted.status_code == 405


async def test_every_401_points_at_the_metadata(server: GatewayServer) -> None:
    pointer = f'resource_metadata="{server.base}/.well-known/oauth-protected-resource/mcp"'
    async with httpx2.AsyncClient(timeout=WAIT) as http:
        missing = await http.post(server.mcp_url, json=INIT, headers=MCP_HEADERS)
        wrong = await http.post(server.mcp_url, json=INIT, headers={**MCP_HEADERS, "Authorization": "Bearer nope"})
        device = await http.post(server.mcp_url, json=INIT, headers={
            **MCP_HEADERS, "Authorization": f"Bearer {server.store.tokens.create('device', 'd1')[1]}"})
        good = await http.post(server.mcp_url, json=INIT, headers={
            **MCP_HEADERS, "Authorization": f"Bearer {server.token('ide', 'read')}"})
        wrong_again = await http.post(server.mcp_url, json=INIT, headers={  # the gateway built: its own check
            **MCP_HEADERS, "Authorization": "Bearer nope"})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == f"Bearer {pointer}"
    for refused in (wrong, wrong_again):
        assert refused.status_code == 401, refused.text
        assert refused.headers["www-authenticate"] == f'Bearer error="invalid_token", {pointer}'
        assert "error" in refused.json()
    assert device.status_code == 403 and "www-authenticate" not in device.headers
    assert good.status_code == 200


async def test_the_sdk_oauth_discovery_reads_the_metadata(tmp_path: Path) -> None:
    from mcp.client.auth import OAuthClientProvider
    from mcp.client.auth.utils import (
        build_protected_resource_metadata_discovery_urls,
        extract_resource_metadata_from_www_auth,
    )
    from mcp.shared.auth import OAuthClientInformationFull, OAuthClientMetadata, OAuthToken

    class Memory:
        async def get_tokens(self) -> OAuthToken | None:
            return None

        async def set_tokens(self, tokens: OAuthToken) -> None:
            pass

        async def get_client_info(self) -> OAuthClientInformationFull | None:
            return None

        async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
            pass

    server = await GatewayServer(tmp_path, mcp_authorization_servers=[ISSUER]).start()
    try:
        provider = OAuthClientProvider(server.mcp_url, OAuthClientMetadata(redirect_uris=["http://127.0.0.1:1/cb"]),
                                       Memory(), None, None)
        async with httpx2.AsyncClient(timeout=WAIT) as http:
            refused = await http.post(server.mcp_url, json=INIT, headers=MCP_HEADERS)
            pointer = extract_resource_metadata_from_www_auth(refused)
            urls = build_protected_resource_metadata_discovery_urls(pointer, server.mcp_url)
            assert urls[0] == f"{server.base}/.well-known/oauth-protected-resource/mcp"
            for url in urls:  # every place the SDK looks answers the same document
                found = await provider._handle_protected_resource_response(await http.get(url))
                assert found, url
                metadata = provider.context.protected_resource_metadata
                assert metadata is not None and str(metadata.resource) == server.mcp_url
                await provider._validate_resource_match(metadata)  # raises when it is not this server's
        assert provider.context.auth_server_url == ISSUER
        assert metadata.scopes_supported == list(SCOPES) and metadata.bearer_methods_supported == ["header"]
    finally:
        await server.stop()


@pytest.mark.parametrize("bad", [None, "nope"])
async def test_the_typescript_sdk_oauth_discovery_reads_the_metadata(server: GatewayServer, bad: str | None) -> None:
    """The TypeScript SDK accepts metadata without `authorization_servers` (RFC 9728 makes it optional)."""
    script = Path(__file__).parent / "node" / "auth_discovery.cjs"
    process = await asyncio.create_subprocess_exec(
        "node", str(script), server.mcp_url, *([bad] if bad else []), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**os.environ, "NODE_PATH": str(NODE_MODULES)})
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report["status"] == 401 and report["error"] == ("invalid_token" if bad else None)
    assert report["pointer"] == f"{server.base}/.well-known/oauth-protected-resource/mcp"
    for document in (report["byPointer"], report["byWellKnown"]):
        assert document["resource"] == server.mcp_url and document["scopes_supported"] == list(SCOPES)
    assert report["allowed"] is True
