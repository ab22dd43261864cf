"""The `oidc:` settings: which external issuers' tokens the server accepts, and what their claims grant.

Written with pydantic only (no PyJWT, no network): the server's settings import it at start-up.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tether.addresses import is_loopback

# Asymmetric algorithms only: `none` carries no signature, and an HS* key would be the issuer's public key,
# which anyone can read (the classic RS256 → HS256 confusion).
ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
DEFAULT_ALGORITHMS = ["RS256", "ES256", "EdDSA"]
_CLAIM = re.compile(r"^[A-Za-z0-9_:/+-]+(\.[A-Za-z0-9_:/+-]+)*$")  # a claim, or a dotted path into nested ones
_LABEL = re.compile(r"^[a-z][a-z0-9-]{0,31}$")


def is_loopback_url(url: str) -> bool:
    """Whether an http(s) URL names this machine (`localhost`, 127.0.0.0/8, ::1): only there may an issuer or
    its keys be reached over plain http (tests, a local issuer)."""
    return is_loopback(urlsplit(url).hostname or "")


def check_url(url: str, what: str) -> str:
    """`url` if it is https, or http on loopback; ValueError naming `what` otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("https", "http") or not parts.hostname or parts.username or parts.password \
            or parts.query or parts.fragment:
        raise ValueError(f"{what} {url!r} is not an https:// URL (without user, query or fragment)")
    if parts.scheme == "http" and not is_loopback_url(url):
        raise ValueError(f"{what} {url!r} must use https (plain http only for 127.0.0.1 or localhost)")
    return url.strip()


class OidcGrant(BaseModel):
    """One rule: a token whose `claim` holds `value` gets these scopes and reaches these devices and tags."""

    model_config = ConfigDict(extra="forbid")

    claim: str = Field(description=(
        "the claim looked at (a dotted path reaches into nested claims, e.g. realm_access.roles); a string is "
        "split on spaces (as `scope` is), a list is taken whole"))
    value: str = Field(min_length=1, description="the value it must hold for this rule to apply")
    scopes: list[str] = Field(default_factory=list, description=(
        "tether scopes granted: read, execute, approve, admin, sample"))
    devices: list[str] = Field(default_factory=list, description=(
        "device names or globs reached ('*': every device)"))
    tags: list[str] = Field(default_factory=list, description="device tags reached")

    @field_validator("claim")
    @classmethod
    def _claim(cls, claim: str) -> str:
        if not _CLAIM.match(claim):
            raise ValueError(f"{claim!r} is not a claim name (or a dotted path of claim names)")
        return claim

    @field_validator("scopes")
    @classmethod
    def _scopes(cls, scopes: list[str]) -> list[str]:
        from tether.server.store.tokens import SCOPES

        unknown = [s for s in scopes if s not in SCOPES]
        if unknown:
            raise ValueError(f"unknown scope(s) {', '.join(unknown)}; choose from {', '.join(SCOPES)}")
        return list(dict.fromkeys(scopes))


class OidcIssuer(BaseModel):
    """An OpenID Connect issuer whose signed tokens (JWTs) the server accepts as API tokens (docs/oidc.md)."""

    model_config = ConfigDict(extra="forbid")

    issuer: str = Field(description=(
        "the issuer URL, exactly as its tokens' `iss` says; https (plain http only on 127.0.0.1 or localhost). "
        "Its keys are found through {issuer}/.well-known/openid-configuration"))
    audience: list[str] = Field(default_factory=list, description=(
        "the `aud` values accepted; default: the server's resource URL as the request reached it "
        "(https://HOST/mcp, which /mcp's Protected Resource Metadata names) or its origin (https://HOST)"))
    jwks_uri: str | None = Field(None, description="the issuer's keys (JWKS) URL; default: from its discovery document")
    algorithms: list[str] = Field(default_factory=lambda: list(DEFAULT_ALGORITHMS), description=(
        f"signature algorithms accepted, of {', '.join(ALGORITHMS)} (never none or HS*)"))
    jwks_refresh_s: float = Field(300.0, ge=1, le=86_400, description=(
        "the keys are read again when older than this; a token naming a key id (kid) the server does not hold "
        "makes at most one early re-read per this many seconds"))
    clock_skew_s: float = Field(60.0, ge=0, le=600, description="leeway in seconds for exp, nbf and iat")
    label: str = Field("oidc", description=(
        "the prefix of the names these tokens act under: the audit shows api:LABEL:SUBJECT"))
    name_claim: str = Field("sub", description=(
        "the claim naming who acted (e.g. sub, email, preferred_username)"))
    agent: bool = Field(True, description=(
        "these tokens are an agent's: they never approve nor hold admin, whatever they map to "
        "(false: a person's, for an issuer only people log in to)"))
    confirm: Literal["never", "destructive", "always"] = Field("never", description=(
        "plans of the tasks these tokens create that wait for a person, as `tether token create --confirm`"))
    grants: list[OidcGrant] = Field(default_factory=list, description=(
        "rules from claims to scopes, devices and tags; a token gets the union of the rules its claims meet"))
    devices_claim: str | None = Field(None, description="a claim whose values are device names or globs reached")
    tags_claim: str | None = Field(None, description="a claim whose values are device tags reached")
    advertise: bool = Field(True, description="name this issuer in /mcp's authorization_servers (RFC 9728)")

    @field_validator("issuer")
    @classmethod
    def _issuer(cls, url: str) -> str:
        return check_url(url, "issuer")

    @field_validator("jwks_uri")
    @classmethod
    def _jwks(cls, url: str | None) -> str | None:
        return None if url is None else check_url(url, "jwks_uri")

    @field_validator("audience", mode="before")
    @classmethod
    def _audience(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("algorithms")
    @classmethod
    def _algorithms(cls, algorithms: list[str]) -> list[str]:
        bad = [a for a in algorithms if a not in ALGORITHMS]
        if bad:
            raise ValueError(f"algorithm(s) {', '.join(bad)} refused: use some of {', '.join(ALGORITHMS)} "
                             "(never none, never HS*: a shared secret cannot be an issuer's public key)")
        if not algorithms:
            raise ValueError("give at least one algorithm")
        return list(dict.fromkeys(algorithms))

    @field_validator("label")
    @classmethod
    def _label(cls, label: str) -> str:
        if not _LABEL.match(label):
            raise ValueError(f"label {label!r}: 1-32 lower-case letters, digits or '-', starting with a letter")
        return label

    @field_validator("name_claim", "devices_claim", "tags_claim")
    @classmethod
    def _claims(cls, claim: str | None) -> str | None:
        if claim is not None and not _CLAIM.match(claim):
            raise ValueError(f"{claim!r} is not a claim name (or a dotted path of claim names)")
        return claim

    @model_validator(mode="after")
    def _grants(self) -> OidcIssuer:
        if not self.grants:
            raise ValueError(f"issuer {self.issuer}: give at least one grant (a claim, its value and the scopes "
                             "and devices it grants); a token whose claims meet none is refused")
        if self.agent:
            held = sorted({s for g in self.grants for s in g.scopes if s in ("approve", "admin")})
            if held:
                raise ValueError(f"issuer {self.issuer}: its tokens are an agent's (agent: true), which never hold "
                                 f"{', '.join(held)}; set agent: false for an issuer only people log in to")
        return self


def issuer_list(value: object) -> object:
    """The `oidc:` setting as a list: one issuer may be written as a mapping."""
    if value is None:
        return []
    return [value] if isinstance(value, dict | OidcIssuer) else value
