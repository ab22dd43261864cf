"""`OidcVerifier`: a JWT from a configured issuer checked against its keys and mapped to a `TokenInfo`.

Checked: the algorithm (the issuer's list: asymmetric only, and the key's own type and `alg`), the signature,
`iss` (exactly a configured issuer), `aud`, `exp`, `nbf` and `iat` (within the issuer's clock skew; `exp` and
`iat` required). Then the claims are mapped by the issuer's grants (config.py): the union of the scopes,
devices and tags of the rules the claims meet, plus the devices/tags claims. A token that verifies but maps
to no scope or no device is refused 403, naming who it is and why.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

from tether.errors import ServerError
from tether.server.store.tokens import SCOPE_DEVICE, SCOPE_TAG, TokenInfo
from tether.server.trust.oidc.config import OidcIssuer
from tether.server.trust.oidc.keys import IssuerKeys, KeysUnavailable

MAX_TOKEN_CHARS = 16 * 1024
ID_PREFIX = "oidc_"  # the ids of the identities these tokens act as (never a tether token's: those are hex)
_SUBJECT = re.compile(r"^[A-Za-z0-9._@+|:=-]{1,200}$")
_CACHE_SIZE = 4096  # verified tokens kept (cleared whole when full)
_CACHE_FOR_S = 300.0  # a verified token is answered from memory at most this long (and never past its exp)
_B64URL = re.compile(r"[A-Za-z0-9_-]+")
_CURVES = {"P-256": "ES256", "P-384": "ES384", "P-521": "ES512"}


class OidcRefused(ServerError):
    """A bearer token from an OIDC issuer is refused: `status` 401 (not valid: the message says why), 403 (valid,
    but its claims grant nothing here) or 503 (the issuer's keys cannot be read)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class OidcVerifier:
    """Checks JWTs of the configured issuers (see the module docstring); one per server."""

    def __init__(self, issuers: Sequence[OidcIssuer]) -> None:
        self._issuers = {issuer.issuer: (issuer, IssuerKeys(issuer)) for issuer in issuers}
        self._cache: dict[tuple[str, str | None], tuple[TokenInfo, float]] = {}

    def keys(self, issuer: str) -> IssuerKeys:
        """The key holder of a configured issuer (KeyError for another)."""
        return self._issuers[issuer][1]

    async def verify(self, token: str, origin: str | None, *, check_audience: bool = True) -> TokenInfo:
        """The `TokenInfo` a valid token of a configured issuer acts as; OidcRefused otherwise. `origin`
        (`scheme://host[:port]` of the request) gives the default audience (`{origin}/mcp` or `{origin}`) of an
        issuer that configures none; `check_audience=False` skips the audience and only says whether the token is
        a valid one (the request guard's body cap)."""
        import jwt

        digest = hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()
        key = (digest, origin if check_audience else "\0any")
        cached = self._cache.get(key)
        if cached is not None and time.time() < cached[1]:
            return cached[0]
        if len(token) > MAX_TOKEN_CHARS:
            raise OidcRefused(401, f"the token is longer than {MAX_TOKEN_CHARS} characters")
        header, unverified = peek(token)  # what names the issuer and its key; PyJWT checks it all again below
        iss = unverified.get("iss")
        if not isinstance(iss, str) or iss not in self._issuers:
            raise OidcRefused(401, f"the token's issuer {str(iss)[:200]!r} is not one this server accepts")
        issuer, keys = self._issuers[iss]
        alg = header.get("alg")
        if alg not in issuer.algorithms:
            raise OidcRefused(401, f"the token's algorithm {str(alg)[:20]!r} is refused: issuer {iss} may sign with "
                                   f"{', '.join(issuer.algorithms)}")
        kid = header.get("kid")
        if kid is not None and (not isinstance(kid, str) or len(kid) > 256):
            raise OidcRefused(401, "the token's key id (kid) is not a short string")
        try:
            jwk = await keys.key(kid)
        except KeysUnavailable as exc:
            raise OidcRefused(503, str(exc)) from None
        if jwk is None:
            raise OidcRefused(401, f"issuer {iss} has no key {str(kid)[:80]!r}" if kid is not None else
                                   f"the token names no key id (kid) and issuer {iss} has several keys")
        if not key_fits(jwk, str(alg)):
            raise OidcRefused(401, f"the key {str(kid)[:80]!r} of issuer {iss} is not for {alg}")
        audiences = issuer.audience or ([f"{origin}/mcp", origin] if origin else [])
        verify_aud = check_audience and bool(audiences)
        if check_audience and not audiences:
            raise OidcRefused(401, f"no audience to check the token against: set the audience of issuer {iss}")
        try:
            claims = jwt.decode(token, jwk.key, algorithms=[str(alg)], audience=audiences if verify_aud else None,
                                issuer=iss, leeway=issuer.clock_skew_s,
                                options={"require": ["exp", "iat", "iss"], "verify_aud": verify_aud,
                                         "strict_aud": False})
        except jwt.ExpiredSignatureError:
            raise OidcRefused(401, "the token has expired") from None
        except jwt.InvalidAudienceError:
            raise OidcRefused(401, f"the token's audience (aud) is not this server ({', '.join(audiences)})") from None
        except jwt.MissingRequiredClaimError as exc:
            raise OidcRefused(401, f"the token lacks the {exc.claim!r} claim") from None
        except jwt.ImmatureSignatureError:
            raise OidcRefused(401, "the token is not valid yet (nbf or iat in the future)") from None
        except jwt.PyJWTError as exc:
            raise OidcRefused(401, f"the token does not verify: {exc}") from None
        info = mapped(issuer, claims)
        now = time.time()
        if len(self._cache) >= _CACHE_SIZE:
            self._cache.clear()
        self._cache[key] = (info, min(float(claims["exp"]), now + _CACHE_FOR_S))
        return info


def is_oidc(who: TokenInfo) -> bool:
    """Whether a caller is an OIDC identity (its token verified here), not one of tether's own tokens."""
    return who.id.startswith(ID_PREFIX)


def peek(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A JWT's header and claims, read without checking anything (to find its issuer and key); OidcRefused 401
    when it is not three base64url parts of which the first two are JSON objects."""
    parts = token.split(".")
    try:
        if len(parts) != 3 or not all(_B64URL.fullmatch(p) for p in parts[:2]):
            raise ValueError("not three base64url parts")
        header, claims = (json.loads(base64.urlsafe_b64decode(p + "=" * (-len(p) % 4))) for p in parts[:2])
    except ValueError as exc:  # binascii.Error and JSONDecodeError are ValueErrors
        raise OidcRefused(401, f"the token is not a valid JWT: {exc}") from None
    if not isinstance(header, dict) or not isinstance(claims, dict):
        raise OidcRefused(401, "the token is not a valid JWT: its header and claims must be JSON objects")
    return header, claims


def key_fits(jwk: Any, alg: str) -> bool:
    """Whether a JWK may verify `alg`: its type's family (RSA: RS*/PS*, EC: the ES* of its curve, OKP Ed25519:
    EdDSA), and its own `alg` when it names one."""
    data = getattr(jwk, "_jwk_data", {}) or {}
    if data.get("alg") not in (None, alg):
        return False
    kty = data.get("kty")
    if kty == "RSA":
        return alg[:2] in ("RS", "PS")
    if kty == "EC":
        return _CURVES.get(str(data.get("crv"))) == alg
    return kty == "OKP" and data.get("crv") == "Ed25519" and alg == "EdDSA"


def claim_values(claims: dict[str, Any], path: str) -> list[str]:
    """The values of a claim (a dotted path reaches into nested objects): a string split on spaces, a list's
    strings; nothing for anything else."""
    value: Any = claims
    for part in path.split("."):
        if not isinstance(value, dict):
            return []
        value = value.get(part)
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


def _names(values: Iterable[str], pattern: re.Pattern[str]) -> list[str]:
    return [v for v in values if pattern.match(v)]


def mapped(issuer: OidcIssuer, claims: dict[str, Any]) -> TokenInfo:
    """The `TokenInfo` a verified token's claims map to by the issuer's grants; OidcRefused 403 when they map
    to no scope or no device, or name nobody usable."""
    subject = claims.get(issuer.name_claim) if "." not in issuer.name_claim else \
        next(iter(claim_values(claims, issuer.name_claim)), None)
    if isinstance(subject, int) and not isinstance(subject, bool):
        subject = str(subject)
    if not isinstance(subject, str) or not _SUBJECT.match(subject):
        raise OidcRefused(403, f"the token's {issuer.name_claim!r} claim does not name who acts (1-200 letters, "
                               "digits or ._@+|:=-)")
    who = f"{issuer.label}:{subject}"
    scopes: set[str] = set()
    devices: list[str] = []
    tags: list[str] = []
    for grant in issuer.grants:
        if grant.value in claim_values(claims, grant.claim):
            scopes.update(grant.scopes)
            devices += grant.devices
            tags += grant.tags
    if issuer.devices_claim:
        devices += _names(claim_values(claims, issuer.devices_claim), SCOPE_DEVICE)
    if issuer.tags_claim:
        tags += _names(claim_values(claims, issuer.tags_claim), SCOPE_TAG)
    if not scopes:
        raise OidcRefused(403, f"the token of {who} (issuer {issuer.issuer}) maps to no tether scope: its claims "
                               "meet none of the issuer's grants that give one")
    if not devices and not tags:
        raise OidcRefused(403, f"the token of {who} (issuer {issuer.issuer}) maps to no device: no grant it meets "
                               "names devices or tags, and no devices/tags claim names one")
    identity = hashlib.sha256(f"{issuer.issuer}\0{subject}".encode()).hexdigest()[:12]
    return TokenInfo(id=f"{ID_PREFIX}{identity}", kind="api", name=who, scopes=sorted(scopes),
                     created_at=float(claims.get("iat") or time.time()), last_used_at=time.time(),
                     confirm=issuer.confirm, devices=list(dict.fromkeys(devices))[:100],
                     tags=list(dict.fromkeys(tags))[:100], agent=issuer.agent)
