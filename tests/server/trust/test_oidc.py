"""Tokens of an external OpenID Connect issuer (docs/oidc.md), against a real issuer and a real server.

The issuer is an HTTP server on 127.0.0.1 (bench/kit/oidc_issuer.py) serving discovery and JWKS with keys made
here; the tether server runs under uvicorn on a real socket with three real devices (alpha; beta tagged lab;
gamma). Tokens are checked as an attacker would send them: expired, for another audience, from another
issuer, unsigned, HS256 keyed with the issuer's public key, signed by a stranger's key, naming unknown keys
(once, and as a flood: the issuer's JWKS reads are counted), and across a key rotation.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from bench.kit.oidc_issuer import Issuer, IssuerServer
from tests.kits.task import WAIT, AgentServer
from tether.server.trust.oidc.config import OidcIssuer
from tether.server.trust.oidc.keys import IssuerKeys
from tether.tools.policy.model import default_policy

shared = pytest.mark.asyncio(loop_scope="module")  # the async tests share one server (the `world` fixture)

V = "2026-07-28"
ANYWHERE = [{"claim": "scope", "value": "tether.run", "scopes": ["read"], "devices": ["*"]}]


@dataclass
class World:
    server: AgentServer
    main: Issuer
    issuers: dict[str, Issuer]
    roots: dict[str, Path]
    base: str
    admin: str

    @property
    def audience(self) -> str:
        return f"{self.base}/mcp"  # the resource URL /mcp's metadata names: the default audience

    async def call(self, token: str, method: str, path: str, headers: dict[str, str] | None = None,
                   **kw: Any) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.base, timeout=WAIT) as http:
            return await http.request(method, path, headers={"Authorization": f"Bearer {token}", **(headers or {})},
                                      **kw)

    async def write(self, token: str, device: str, name: str) -> httpx.Response:
        command = {"tool_name": "write_file", "parameters": {"file_path": str(self.roots[device] / name),
                                                             "content": "written"}}
        return await self.call(token, "POST", f"/api/v1/devices/{device}/commands", json={"commands": [command]})


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    tmp = tmp_path_factory.mktemp("oidc")
    main = Issuer("main")
    main.add_key("ec1")
    main.add_key("ed1", ed25519.Ed25519PrivateKey.generate())
    main.add_key("rsa1", rsa.generate_private_key(public_exponent=65537, key_size=2048))
    others = {name: Issuer(name) for name in ("strays", "flooded", "rotating", "aging")}
    others.update({name: Issuer(name, hostile=name) for name in ("huge", "liar", "redirect")})
    for issuer in others.values():
        issuer.add_key("k1")
    http = IssuerServer(main, *others.values())
    uv, serving = await http.serve()
    oidc = [{"issuer": main.url, "devices_claim": "tether_devices", "grants": [
        {"claim": "scope", "value": "tether.run", "scopes": ["read", "execute"]},
        {"claim": "groups", "value": "lab-ops", "scopes": ["read", "execute"], "tags": ["lab"]}]}]
    oidc += [{"issuer": issuer.url, "grants": ANYWHERE, "jwks_refresh_s": 3600} for issuer in others.values()]
    try:
        # failed credentials throttle an address after 30 (request_guard): raised, so that the flood below reaches
        # the key lookup, as an attacker's from many addresses would
        async with AgentServer(tmp, oidc=oidc, auth_failure_burst=10_000) as server:
            roots = {}
            for name in ("alpha", "beta", "gamma"):
                roots[name] = tmp / name
                roots[name].mkdir()
                policy = default_policy().model_copy(update={"read_roots": [str(roots[name])],
                                                             "write_roots": [str(roots[name])]})
                await server.add_device(name, policy, tmp / f"state-{name}")
            admin = server.store.tokens.create("api", "admin", ["admin"])[1]
            tagged = await server.api.patch("/devices/beta", json={"tags": ["lab"]},
                                            headers={"Authorization": f"Bearer {admin}"})
            assert tagged.status_code == 200, tagged.text
            yield World(server, main, others, roots, f"http://127.0.0.1:{server.port}", admin)
    finally:
        uv.should_exit = True
        await asyncio.wait_for(serving, WAIT)


def test_the_settings_refuse_what_cannot_be_safe() -> None:
    grants = ANYWHERE
    for bad, said in (({"algorithms": ["HS256"]}, "never none, never HS"), ({"algorithms": ["none"]}, "refused"),
                      ({"issuer": "http://login.example.com"}, "must use https"),
                      ({"grants": []}, "at least one grant"),
                      ({"grants": [{**grants[0], "scopes": ["approve"]}]}, "agent"),
                      ({"grants": [{**grants[0], "scopes": ["root"]}]}, "unknown scope")):
        with pytest.raises(pydantic.ValidationError, match=said):
            OidcIssuer(**{"issuer": "https://login.example.com", "grants": grants, **bad})
    local = OidcIssuer(issuer="http://127.0.0.1:9/x", grants=grants)
    assert local.algorithms == ["RS256", "ES256", "EdDSA"] and local.agent


@shared
async def test_a_token_runs_commands_only_where_its_claims_reach_and_is_audited_by_subject(world: World) -> None:
    alice = world.main.token("ec1", world.audience, sub="alice", scope="openid tether.run", tether_devices=["alpha"])
    ran = await world.write(alice, "alpha", "by-alice.txt")
    assert ran.status_code == 200 and ran.json()["results"][0]["status"] == "success", ran.text
    assert (world.roots["alpha"] / "by-alice.txt").read_text() == "written"
    refused = await world.write(alice, "gamma", "by-alice.txt")
    assert refused.status_code == 404 and "scope of token 'oidc:alice'" in refused.json()["error"], refused.text
    assert not (world.roots["gamma"] / "by-alice.txt").exists()

    # a group grants a tag: beta (tagged lab) and nothing else; signed with EdDSA
    bob = world.main.token("ed1", world.audience, sub="bob", groups=["lab-ops"])
    assert (await world.write(bob, "beta", "by-bob.txt")).json()["results"][0]["status"] == "success"
    assert (await world.write(bob, "alpha", "by-bob.txt")).status_code == 404
    assert not (world.roots["alpha"] / "by-bob.txt").exists()
    # RS256, and the device list is the token's scope
    listed = await world.call(world.main.token("rsa1", world.audience, sub="bob", groups=["lab-ops"]),
                              "GET", "/api/v1/devices")
    assert [d["name"] for d in listed.json()] == ["beta"], listed.text

    world.server.store.audit.flush()
    rows = [r for r in world.server.store.audit.rows(limit=50) if r["tool_name"] == "write_file"]
    assert {(r["device"], r["requested_by"]) for r in rows} >= {("alpha", "api:oidc:alice"), ("beta", "api:oidc:bob")}
    found = (await world.call(world.admin, "GET", "/api/v1/audit", params={"token": "oidc:alice"})).json()["rows"]
    assert found and {r["requested_by"] for r in found} == {"api:oidc:alice"}, found

    hook = await world.call(alice, "POST", "/api/v1/webhooks", json={"url": "https://hooks.example/x"})
    assert hook.status_code == 403 and "cannot own a webhook" in hook.json()["error"], hook.text

    # verified, but granting nothing: 403 saying so
    carol = world.main.token("ec1", world.audience, sub="carol", scope="openid profile", tether_devices=["alpha"])
    nothing = await world.write(carol, "alpha", "by-carol.txt")
    assert nothing.status_code == 403 and "oidc:carol" in nothing.json()["error"] \
        and "maps to no tether scope" in nothing.json()["error"], nothing.text
    dave = world.main.token("ec1", world.audience, sub="dave", scope="tether.run")
    nowhere = await world.write(dave, "alpha", "by-dave.txt")
    assert nowhere.status_code == 403 and "maps to no device" in nowhere.json()["error"], nowhere.text
    assert not list(world.roots["alpha"].glob("by-[cd]*"))

    # the dashboard takes the token at its login (until it expires), and refuses one that grants nothing
    async with httpx.AsyncClient(base_url=world.base, timeout=WAIT) as browser:
        assert (await browser.post("/web/login", json={"token": carol})).status_code == 403
        login = await browser.post("/web/login", json={"token": alice})
        assert login.status_code == 200 and login.json()["name"] == "oidc:alice", login.text
        assert (await browser.get("/web/session")).json()["name"] == "oidc:alice"
        assert [d["name"] for d in (await browser.get("/api/v1/devices")).json()] == ["alpha"]  # the cookie alone


@shared
async def test_forged_stale_and_foreign_tokens_are_refused(world: World) -> None:
    main, aud, now = world.main, world.audience, time.time()
    claims = {"sub": "mallory", "scope": "tether.run", "tether_devices": ["*"]}
    stranger = ec.generate_private_key(ec.SECP256R1())
    body = {"iss": main.url, "aud": aud, "iat": int(now), "exp": int(now + 600), **claims}
    cases = {
        "expired": (main.token("ec1", aud, issued=now - 7200, **claims), "expired"),
        "another audience": (main.token("ec1", "https://elsewhere.example/mcp", **claims), "audience"),
        "not yet valid": (main.token("ec1", aud, nbf=int(now + 3600), **claims), "not valid yet"),
        "another issuer": (main.token("ec1", aud, iss=f"{main.url}-evil", **claims), "not one this server accepts"),
        "a stranger's key under a known kid": (main.token("ec1", aud, key=stranger, **claims), "does not verify"),
        "alg none": (main.forged({"alg": "none", "typ": "JWT", "kid": "ec1"}, body, None), "'none' is refused"),
        "HS256 keyed with the public key": (main.forged({"alg": "HS256", "typ": "JWT", "kid": "rsa1"}, body,
                                                        main.public_pem("rsa1")), "'HS256' is refused"),
    }
    reads = main.jwks_reads
    for case, (token, said) in cases.items():
        answer = await world.write(token, "alpha", "forged.txt")
        assert answer.status_code == 401, (case, answer.text)
        assert said in answer.json()["error"], (case, answer.text)
    assert not (world.roots["alpha"] / "forged.txt").exists()
    assert main.jwks_reads == reads  # none of them named an unknown key: nothing made the server ask the issuer


@shared
async def test_an_unknown_kid_reads_the_keys_once_then_is_refused(world: World) -> None:
    issuer = world.issuers["strays"]
    good = issuer.token("k1", world.audience, sub="s", scope="tether.run")
    assert (await world.call(good, "GET", "/api/v1/devices")).status_code == 200
    assert issuer.jwks_reads == 1
    stray = issuer.token("k9", world.audience, key=ec.generate_private_key(ec.SECP256R1()), sub="s", scope="tether.run")
    refused = await world.call(stray, "GET", "/api/v1/devices")
    assert refused.status_code == 401 and "has no key 'k9'" in refused.json()["error"], refused.text
    assert issuer.jwks_reads == 2  # read once more, in case the issuer had rotated
    assert (await world.call(stray, "GET", "/api/v1/devices")).status_code == 401
    assert issuer.jwks_reads == 2  # and not again within the interval


@shared
async def test_a_flood_of_unknown_kids_reads_the_keys_at_most_once(world: World) -> None:
    issuer = world.issuers["flooded"]
    good = issuer.token("k1", world.audience, sub="f", scope="tether.run")
    assert (await world.call(good, "GET", "/api/v1/devices")).status_code == 200
    before = issuer.jwks_reads
    key = ec.generate_private_key(ec.SECP256R1())
    flood = [issuer.token(secrets.token_hex(8), world.audience, key=key, sub=f"x{i}", scope="tether.run")
             for i in range(60)]
    async with httpx.AsyncClient(base_url=world.base, timeout=WAIT) as http:
        answers = await asyncio.gather(*(http.get("/api/v1/devices", headers={"Authorization": f"Bearer {t}"})
                                         for t in flood))
    assert {a.status_code for a in answers} == {401}
    assert issuer.jwks_reads - before <= 1, issuer.jwks_reads - before
    assert (await world.call(good, "GET", "/api/v1/devices")).status_code == 200  # its real keys still held


@shared
async def test_a_rotated_key_is_picked_up_and_the_retired_one_refused(world: World) -> None:
    issuer = world.issuers["rotating"]
    assert (await world.call(issuer.token("k1", world.audience, sub="r", scope="tether.run"),
                             "GET", "/api/v1/devices")).status_code == 200
    retired = issuer.keys.pop("k1")
    issuer.add_key("k2")
    fresh = issuer.token("k2", world.audience, sub="r", scope="tether.run")
    assert (await world.call(fresh, "GET", "/api/v1/devices")).status_code == 200
    old = issuer.token("k1", world.audience, key=retired, sub="r2", scope="tether.run")
    refused = await world.call(old, "GET", "/api/v1/devices")
    assert refused.status_code == 401 and "has no key 'k1'" in refused.json()["error"], refused.text


@shared
async def test_old_keys_are_read_again_behind_the_request(world: World) -> None:
    issuer = world.issuers["aging"]
    keys = IssuerKeys(OidcIssuer(issuer=issuer.url, grants=ANYWHERE, jwks_refresh_s=3600))
    assert await keys.key("k1") is not None and issuer.jwks_reads == 1
    issuer.add_key("k2")
    keys._read_at = (keys._read_at or 0) - 3600  # an interval old, instead of waiting an hour
    assert await keys.key("k1") is not None
    assert issuer.jwks_reads == 1  # the request had its answer before the re-read began
    assert keys._refreshing is not None
    await asyncio.wait_for(keys._refreshing, WAIT)
    assert issuer.jwks_reads == 2 and await keys.key("k2") is not None and issuer.jwks_reads == 2


@shared
async def test_an_issuer_answering_too_much_lying_or_redirecting_is_not_followed(world: World) -> None:
    for name, said in (("huge", "more than the 262144 bytes allowed"), ("liar", "names another issuer"),
                       ("redirect", "answered 302")):
        issuer = world.issuers[name]
        token = issuer.token("k1", world.audience, sub="h", scope="tether.run")
        answer = await world.call(token, "GET", "/api/v1/devices")
        assert answer.status_code == 503 and said in answer.json()["error"], (name, answer.text)
        reads = (issuer.discovery_reads, issuer.jwks_reads)
        again = await world.call(token, "GET", "/api/v1/devices")
        assert again.status_code == 503 and (issuer.discovery_reads, issuer.jwks_reads) == reads, name  # no retry yet


@shared
async def test_the_gateway_names_the_issuer_and_acts_for_its_tokens(world: World) -> None:
    async with httpx.AsyncClient(base_url=world.base, timeout=WAIT) as http:
        metadata = (await http.get("/.well-known/oauth-protected-resource/mcp")).json()
        assert metadata["resource"] == world.audience and world.main.url in metadata["authorization_servers"]
        bare = await http.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        pointer = f'resource_metadata="{world.base}/.well-known/oauth-protected-resource/mcp"'
        assert bare.status_code == 401 and pointer in bare.headers["www-authenticate"]

    async def mcp(token: str, method: str, params: dict[str, Any]) -> httpx.Response:
        meta = {"io.modelcontextprotocol/protocolVersion": V, "io.modelcontextprotocol/clientCapabilities": {},
                "io.modelcontextprotocol/clientInfo": {"name": "oidc-test", "version": "1"}}
        headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": V, "Mcp-Method": method,
                   **({"Mcp-Name": params["name"]} if "name" in params else {})}
        return await world.call(token, "POST", "/mcp", headers=headers, json={
            "jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": meta}})

    claims = {"scope": "tether.run", "tether_devices": ["alpha"]}
    elsewhere = await mcp(world.main.token("ec1", "https://elsewhere.example/mcp", sub="alice", **claims),
                          "tools/list", {})
    assert elsewhere.status_code == 401 and 'error="invalid_token"' in elsewhere.headers["www-authenticate"]
    assert "audience" in elsewhere.json()["error"]
    empty = await mcp(world.main.token("ec1", world.audience, sub="carol", scope="openid"), "tools/list", {})
    assert empty.status_code == 403 and "maps to no tether scope" in empty.json()["error"]

    alice = world.main.token("ec1", world.audience, sub="alice", **claims)
    listed = await mcp(alice, "tools/list", {})
    assert listed.status_code == 200, listed.text
    names = [t["name"] for t in listed.json()["result"]["tools"]]
    assert "alpha__write_file" in names and not [n for n in names if n.startswith(("beta__", "gamma__"))]
    target = world.roots["alpha"] / "through-mcp.txt"
    called = await mcp(alice, "tools/call", {"name": "alpha__write_file",
                                             "arguments": {"file_path": str(target), "content": "via mcp"}})
    assert called.status_code == 200, called.text
    text = called.text if not called.headers["content-type"].startswith("text/event-stream") else \
        [line[5:] for line in called.text.splitlines() if line.startswith("data:")][-1]
    assert "error" not in json.loads(text) and target.read_text() == "via mcp", text
    world.server.store.audit.flush()
    rows = [r for r in world.server.store.audit.rows(limit=50) if r["tool_name"] == "write_file"
            and r["device"] == "alpha" and str(r["requested_by"]).startswith("mcp:")]
    assert rows and rows[0]["requested_by"].endswith("by api:oidc:alice"), rows
