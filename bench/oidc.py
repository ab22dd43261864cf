"""What an OpenID Connect token costs a request, against tether's own API token.

    python -m bench.oidc [N]

The server app (tether.server.http.app) under uvicorn on 127.0.0.1 with one issuer configured, the issuer a
real HTTP server on 127.0.0.1 (bench/kit/oidc_issuer.py). Per round, interleaved: N requests of
`GET /api/v1/devices` with (a) a tether API token — the anchor —, (b) one ES256 JWT sent again and again
(verified once, then answered from memory), (c) a fresh ES256 JWT per request and (d) a fresh RS256 JWT per
request (each a full check: decode, signature, claims, mapping). And in process, the check alone:
`Tokens.check` against `OidcVerifier.verify` of fresh ES256 / RS256 / EdDSA tokens.
Figures: the median of ROUNDS rounds' p50, with the spread (min-max), and the ratio to the anchor.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import uvicorn
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from bench.kit.oidc_issuer import Issuer, IssuerServer
from tether.server.http.app import create_app
from tether.server.settings import ServerSettings
from tether.server.store import Store
from tether.server.trust.oidc.verify import OidcVerifier

ROUNDS = 5


def p50(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


async def http_round(client: httpx.AsyncClient, tokens: list[str]) -> float:
    """p50 µs of one GET per token."""
    samples = []
    for token in tokens:
        t0 = time.perf_counter()
        answer = await client.get("/api/v1/devices", headers={"Authorization": f"Bearer {token}"})
        samples.append(time.perf_counter() - t0)
        assert answer.status_code == 200, answer.text
    return p50(samples)


async def main(n: int) -> None:
    issuer = Issuer("bench")
    issuer.add_key("ec1")
    issuer.add_key("rsa1", rsa.generate_private_key(public_exponent=65537, key_size=2048))
    issuer.add_key("ed1", ed25519.Ed25519PrivateKey.generate())
    http = IssuerServer(issuer)
    issuer_server, issuer_task = await http.serve()
    tmp = Path(tempfile.mkdtemp(prefix="bench-oidc-"))
    grants = [{"claim": "scope", "value": "tether.run", "scopes": ["read"], "devices": ["*"]}]
    settings = ServerSettings(db_path=tmp / "server.db", oidc=[{"issuer": issuer.url, "grants": grants}])
    store = Store(settings.db_path)
    tether_token = store.tokens.create("api", "bench", ["read"])[1]
    app = create_app(settings, store)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # proto named: asyncio then
    sock.bind(("127.0.0.1", 0))  # sets TCP_NODELAY on the accepted connections (bench/roundtrip.py, start_server)
    sock.listen(128)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_config=None, log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    audience = f"{base}/mcp"

    made = iter(range(10**9))  # a unique jti per token: a fresh token is never one the server verified before

    def fresh(kid: str, count: int) -> list[str]:
        return [issuer.token(kid, audience, sub=f"u{i}", scope="tether.run", jti=str(next(made))) for i in range(count)]

    rows: dict[str, list[float]] = {"tether API token": [], "one JWT again (cached)": [], "fresh ES256 JWT": [],
                                    "fresh RS256 JWT": []}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        await http_round(client, [tether_token, *fresh("ec1", 1)])  # warm: the keys read, PyJWT imported
        again = fresh("ec1", 1)[0]
        for _ in range(ROUNDS):
            rows["tether API token"].append(await http_round(client, [tether_token] * n))
            rows["one JWT again (cached)"].append(await http_round(client, [again] * n))
            rows["fresh ES256 JWT"].append(await http_round(client, fresh("ec1", n)))
            rows["fresh RS256 JWT"].append(await http_round(client, fresh("rsa1", n)))
    print(f"GET /api/v1/devices, {n} requests a round, {ROUNDS} rounds interleaved (p50 per round; median, spread)")
    anchor = statistics.median(rows["tether API token"])
    for name, values in rows.items():
        mid = statistics.median(values)
        print(f"  {name:<26} p50 {mid:8.1f} us  (spread {min(values):.1f}-{max(values):.1f})  {mid / anchor:5.2f}x")

    verifier = OidcVerifier(settings.oidc)
    checks: dict[str, list[float]] = {"Tokens.check": [], "ES256": [], "RS256": [], "EdDSA": []}
    await verifier.verify(fresh("ec1", 1)[0], base)  # the keys read once
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(n):
            await store.tokens.check(tether_token)
        checks["Tokens.check"].append((time.perf_counter() - t0) / n * 1e6)
        for name, kid in (("ES256", "ec1"), ("RS256", "rsa1"), ("EdDSA", "ed1")):
            tokens = fresh(kid, n)
            t0 = time.perf_counter()
            for token in tokens:
                await verifier.verify(token, base)
            checks[name].append((time.perf_counter() - t0) / n * 1e6)
    print(f"in process, the check alone ({n} a round, mean per check; median of rounds, spread)")
    anchor = statistics.median(checks["Tokens.check"])
    for name, values in checks.items():
        mid = statistics.median(values)
        label = name if name == "Tokens.check" else f"OidcVerifier, fresh {name}"
        print(f"  {label:<30} {mid:8.1f} us  (spread {min(values):.1f}-{max(values):.1f})  {mid / anchor:6.1f}x")
    print(f"JWKS reads by the issuer over the whole run: {issuer.jwks_reads} (the server's and the verifier's first)")
    server.should_exit = True
    await serving
    issuer_server.should_exit = True
    await issuer_task
    store.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
