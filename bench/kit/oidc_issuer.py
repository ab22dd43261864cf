"""A real OpenID Connect issuer for tests and benches: an HTTP server on 127.0.0.1 serving discovery and JWKS
for several issuers (one per path), with keys made here (cryptography) and tokens signed by them (PyJWT, or by
hand for what PyJWT refuses to make: `alg: none`, HS256 keyed with a public key). It counts every JWKS read.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import socket
import time
from typing import Any

import jwt
import uvicorn
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey
ALG = {ec.EllipticCurvePrivateKey: "ES256", ed25519.Ed25519PrivateKey: "EdDSA", rsa.RSAPrivateKey: "RS256"}


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def alg_of(key: PrivateKey) -> str:
    return next(alg for kind, alg in ALG.items() if isinstance(key, kind))


def public_jwk(key: PrivateKey, kid: str) -> dict[str, Any]:
    public = key.public_key()
    algorithm: Any = {"ES256": ECAlgorithm, "EdDSA": OKPAlgorithm, "RS256": RSAAlgorithm}[alg_of(key)]
    jwk: dict[str, Any] = algorithm.to_jwk(public, as_dict=True)
    return {**jwk, "kid": kid, "use": "sig"}


class Issuer:
    """One issuer at `{base}/{name}`: its keys by kid (the JWKS serves their public halves) and its JWKS reads."""

    def __init__(self, name: str, hostile: str | None = None) -> None:
        """`hostile`: how this issuer misbehaves: "huge" (a JWKS past 256 KiB), "liar" (its discovery document
        names another issuer), "redirect" (its JWKS answers 302 elsewhere); None: it behaves."""
        self.name = name
        self.hostile = hostile
        self.url = ""  # set when the server listens
        self.keys: dict[str, PrivateKey] = {}
        self.jwks_reads = 0
        self.discovery_reads = 0

    def add_key(self, kid: str, key: PrivateKey | None = None) -> PrivateKey:
        self.keys[kid] = key or ec.generate_private_key(ec.SECP256R1())
        return self.keys[kid]

    def token(self, kid: str, audience: str | list[str], *, key: PrivateKey | None = None,
              lifetime: float = 600, issued: float | None = None, **claims: Any) -> str:
        """A JWT of this issuer signed with key `kid` (or `key`), for `audience`, with these claims."""
        signer = key or self.keys[kid]
        now = time.time() if issued is None else issued
        body = {"iss": self.url, "aud": audience, "iat": int(now), "exp": int(now + lifetime), **claims}
        return jwt.encode(body, signer, algorithm=alg_of(signer), headers={"kid": kid})  # type: ignore[arg-type]

    def forged(self, header: dict[str, Any], claims: dict[str, Any], secret: bytes | None) -> str:
        """A token written by hand: HS256 keyed with `secret`, or no signature at all (`alg: none`)."""
        signing = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        signature = b"" if secret is None else hmac.new(secret, signing.encode(), hashlib.sha256).digest()
        return f"{signing}.{b64(signature)}"

    def public_pem(self, kid: str) -> bytes:
        return self.keys[kid].public_key().public_bytes(serialization.Encoding.PEM,
                                                        serialization.PublicFormat.SubjectPublicKeyInfo)


class IssuerServer:
    """The ASGI app serving every issuer's discovery document and JWKS."""

    def __init__(self, *issuers: Issuer) -> None:
        self.issuers = {issuer.name: issuer for issuer in issuers}
        self.base = ""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        name, _, rest = scope["path"].lstrip("/").partition("/")
        issuer = self.issuers.get(name)
        body: Any = None
        status, extra = 200, []
        if issuer is not None and rest == ".well-known/openid-configuration":
            issuer.discovery_reads += 1
            named = f"{issuer.url}-other" if issuer.hostile == "liar" else issuer.url
            body = {"issuer": named, "jwks_uri": f"{issuer.url}/jwks", "id_token_signing_alg_values_supported":
                    ["ES256", "EdDSA", "RS256"]}
        elif issuer is not None and rest == "jwks":
            issuer.jwks_reads += 1
            body = {"keys": [public_jwk(key, kid) for kid, key in issuer.keys.items()]}
            if issuer.hostile == "huge":
                body["padding"] = "x" * (300 * 1024)
            elif issuer.hostile == "redirect":
                status, extra = 302, [(b"location", f"{self.base}/elsewhere/jwks".encode())]
        data = json.dumps(body).encode()
        if issuer is not None and issuer.hostile == "huge":  # chunked, no length said: the reader must count
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            for start in range(0, len(data), 16384):
                await send({"type": "http.response.body", "body": data[start:start + 16384], "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": status if body is not None else 404,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                *extra]})
        await send({"type": "http.response.body", "body": data})

    async def serve(self) -> tuple[uvicorn.Server, asyncio.Task[None]]:
        """Listen on 127.0.0.1 (the socket is bound before this returns, so the issuers' URLs are known)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        for issuer in self.issuers.values():
            issuer.url = f"{self.base}/{issuer.name}"
        server = uvicorn.Server(uvicorn.Config(self, lifespan="off", log_config=None, log_level="warning"))
        return server, asyncio.create_task(server.serve(sockets=[sock]))
