"""An issuer's signing keys: found through its discovery document, read from its JWKS, kept, and read again
seldom enough that no token can make the server hammer the issuer.

Every read is a bounded async HTTP GET (`FETCH_TIMEOUT` per step and 2.5 times that for a whole read,
`MAX_DISCOVERY_BYTES` / `MAX_JWKS_BYTES` for the body, no redirects), so the event loop never waits on the
issuer and a slow or huge answer costs little. The keys are read at first use (that request waits) and again
when older than the issuer's `jwks_refresh_s`, in a task of its own (requests meanwhile use the keys held); a
token naming a key id the server does not hold makes one early re-read, at most one per `jwks_refresh_s` (an
attacker sending random key ids gets one); a failed read is retried no sooner than `RETRY_AFTER_FAILURE_S`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from tether.errors import ServerError
from tether.server.trust.oidc.config import OidcIssuer, check_url, is_loopback_url

if TYPE_CHECKING:
    from jwt import PyJWK

logger = logging.getLogger(__name__)

FETCH_TIMEOUT = 5.0  # seconds for one whole GET (connect, headers and body)
MAX_DISCOVERY_BYTES = 64 * 1024
MAX_JWKS_BYTES = 256 * 1024
MAX_KEYS = 100  # keys kept from one JWKS; more are ignored
RETRY_AFTER_FAILURE_S = 10.0
_KEY_TYPES = {"RSA", "EC", "OKP"}  # asymmetric only: an `oct` key would be a shared secret


class KeysUnavailable(ServerError):
    """The issuer's keys could not be read (discovery or JWKS): the message says what failed."""


class IssuerKeys:
    """The signing keys of one issuer (`key(kid)`); `reads` counts the JWKS reads made (for logs and tests)."""

    def __init__(self, issuer: OidcIssuer) -> None:
        self.issuer = issuer
        self.reads = 0
        self._jwks_uri = issuer.jwks_uri
        self._keys: dict[str | None, PyJWK] = {}  # by kid; None for the one key without a kid, if any
        self._read_at: float | None = None  # monotonic time of the last read that succeeded
        self._failed_at: float | None = None
        self._early_at: float | None = None  # the last re-read an unknown kid caused
        self._problem: str | None = None
        self._lock = asyncio.Lock()
        self._refreshing: asyncio.Task[None] | None = None  # the re-read of old keys under way, if any

    async def key(self, kid: str | None) -> PyJWK | None:
        """The key named `kid` (or the issuer's only key when the token names none), reading the keys first when
        there are none, behind the caller when they are old, and once early for an unknown kid (see the module
        docstring); None when the issuer has no such key. KeysUnavailable when no keys could ever be read."""
        refresh = self.issuer.jwks_refresh_s
        if not self._keys:
            await self._read(lambda: not self._keys)
        elif self._read_at is None or time.monotonic() - self._read_at >= refresh:
            self._refresh_behind(refresh)  # this request goes on with the keys held
        found = self._find(kid)
        if found is not None or kid is None:
            return found

        def early_allowed() -> bool:
            return self._find(kid) is None and (
                self._early_at is None or time.monotonic() - self._early_at >= refresh)

        if early_allowed():
            await self._read(early_allowed, early=True)
        return self._find(kid)

    def _refresh_behind(self, refresh: float) -> None:
        """Re-read keys older than `refresh` in a task of their own (one at a time), so that no request waits
        for the issuer while the server holds keys; a failure keeps them (`_read`) and is logged there."""
        if self._refreshing is not None and not self._refreshing.done():
            return
        task = asyncio.get_running_loop().create_task(
            self._read(lambda: self._read_at is None or time.monotonic() - self._read_at >= refresh))
        task.add_done_callback(_log_failure)
        self._refreshing = task

    def _find(self, kid: str | None) -> PyJWK | None:
        if kid is not None:
            return self._keys.get(kid)
        return next(iter(self._keys.values())) if len(self._keys) == 1 else None

    async def _read(self, still_needed: Any, *, early: bool = False) -> None:
        """Read the keys if `still_needed()` holds once the lock is held (a concurrent request may have read
        them meanwhile); a failure keeps the keys held before, and raises only when there are none."""
        async with self._lock:
            now = time.monotonic()
            if not still_needed():
                return
            if self._failed_at is not None and now - self._failed_at < RETRY_AFTER_FAILURE_S:
                if not self._keys:
                    raise KeysUnavailable(self._problem or "the issuer's keys could not be read")
                return
            if early:
                self._early_at = now
            try:
                self._keys = await asyncio.wait_for(self._fetch(), FETCH_TIMEOUT * 2.5)
                self._read_at, self._failed_at, self._problem = time.monotonic(), None, None
            except (KeysUnavailable, TimeoutError) as exc:
                self._failed_at = time.monotonic()
                self._problem = f"the keys of issuer {self.issuer.issuer} could not be read: {exc or 'timed out'}"
                logger.warning("%s", self._problem)
                if not self._keys:
                    raise KeysUnavailable(self._problem) from None

    async def _fetch(self) -> dict[str | None, PyJWK]:
        if self._jwks_uri is None:
            url = self.issuer.issuer.rstrip("/") + "/.well-known/openid-configuration"
            document = await get_json(url, MAX_DISCOVERY_BYTES)
            named = document.get("issuer") if isinstance(document, dict) else None
            if named != self.issuer.issuer:
                raise KeysUnavailable(f"the discovery document at {url} names another issuer ({str(named)[:200]!r})")
            jwks_uri = document.get("jwks_uri")
            if not isinstance(jwks_uri, str):
                raise KeysUnavailable(f"the discovery document at {url} has no jwks_uri")
            try:
                self._jwks_uri = check_url(jwks_uri, "jwks_uri")
            except ValueError as exc:
                raise KeysUnavailable(str(exc)) from None
        self.reads += 1
        return parse_jwks(await get_json(self._jwks_uri, MAX_JWKS_BYTES))


def _log_failure(task: asyncio.Task[None]) -> None:
    """A background re-read's unexpected error, logged (an expected one is logged by `_read` and swallowed)."""
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.warning("re-reading an issuer's keys failed: %r", error)


def parse_jwks(data: Any) -> dict[str | None, PyJWK]:
    """The usable signing keys of a JWKS document by kid: RSA, EC and OKP keys meant for signatures; others
    (`oct`, `use: enc`, malformed, beyond `MAX_KEYS`) left out. KeysUnavailable when none is usable."""
    from jwt import PyJWK
    from jwt.exceptions import PyJWKError

    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise KeysUnavailable("the JWKS is not an object with a 'keys' list")
    keys: dict[str | None, PyJWK] = {}
    for entry in data["keys"][:MAX_KEYS]:
        if not isinstance(entry, dict) or entry.get("kty") not in _KEY_TYPES or entry.get("use", "sig") != "sig":
            continue
        kid = entry.get("kid")
        if kid is not None and not isinstance(kid, str):
            continue
        try:
            keys[kid] = PyJWK(entry)
        except (PyJWKError, ValueError, TypeError) as exc:
            logger.info("a key of the JWKS is left out (%s): %s", kid, exc)
    if not keys:
        raise KeysUnavailable("the JWKS holds no usable signing key")
    return keys


async def get_json(url: str, cap: int) -> Any:
    """GET `url` as JSON: status 200, no redirect, at most `cap` bytes, within `FETCH_TIMEOUT` per step;
    KeysUnavailable saying what failed."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT, follow_redirects=False,
                                     trust_env=not is_loopback_url(url)) as client, \
                client.stream("GET", url, headers={"Accept": "application/json"}) as response:
            if response.status_code != 200:
                raise KeysUnavailable(f"GET {url} answered {response.status_code}")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > cap:
                raise KeysUnavailable(f"GET {url}: {declared} bytes, more than the {cap} allowed")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > cap:
                    raise KeysUnavailable(f"GET {url}: more than the {cap} bytes allowed")
    except httpx.HTTPError as exc:
        raise KeysUnavailable(f"GET {url} failed: {type(exc).__name__} {exc}") from None
    try:
        return json.loads(body)
    except ValueError:
        raise KeysUnavailable(f"GET {url}: the answer is not JSON") from None
