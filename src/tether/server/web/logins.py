"""Browser sessions of the dashboard: an API token exchanged for an HTTP-only cookie.

The token itself never reaches the page's script: the browser holds only a random session id in an
HTTP-only, SameSite=strict cookie, and the page holds a per-session CSRF secret that it sends in the
`X-CSRF-Token` header with every state-changing request. A cross-site form can neither read that
secret nor set a header, so it is refused even where the browser sends the cookie (another port of
the same host is the same *site*). Sessions live in the server's memory: a restart logs everyone
out, which is the safe failure; every request re-checks the token, so revoking it ends its sessions.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass, field

from fastapi import HTTPException, Request

COOKIE = "tether_session"
CSRF_HEADER = "X-CSRF-Token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
MAX_SESSIONS = 10_000
SESSION_TTL_S = 12 * 3600.0


@dataclass
class WebSession:
    secret: str  # the API token, kept in server memory only
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    expires: float = field(default_factory=lambda: time.time() + SESSION_TTL_S)


class WebSessions:
    """The sessions of one app (kept on `app.state`, never at module level)."""

    def __init__(self, ttl: float = SESSION_TTL_S, limit: int = MAX_SESSIONS) -> None:
        self.ttl = ttl
        self.limit = limit
        self._by_id: dict[str, WebSession] = {}

    def open(self, secret: str) -> tuple[str, WebSession]:
        now = time.time()
        if len(self._by_id) >= self.limit:  # expired ones first, then the oldest: the table stays bounded
            for sid in [s for s, v in self._by_id.items() if v.expires <= now] or [next(iter(self._by_id))]:
                self._by_id.pop(sid, None)
        sid = secrets.token_urlsafe(32)
        session = self._by_id[sid] = WebSession(secret, expires=now + self.ttl)
        return sid, session

    def get(self, sid: str | None) -> WebSession | None:
        if not sid:
            return None
        session = self._by_id.get(sid)
        if session is None:
            return None
        if session.expires <= time.time():
            self._by_id.pop(sid, None)
            return None
        return session

    def close(self, sid: str | None) -> None:
        if sid:
            self._by_id.pop(sid, None)

    def bearer_for(self, request: Request) -> str | None:
        """The API token behind the request's session cookie, or None without a live session. A
        state-changing request must carry the session's CSRF secret in `X-CSRF-Token` (403 if not)."""
        session = self.get(request.cookies.get(COOKIE))
        if session is None:
            return None
        if request.method not in SAFE_METHODS:
            sent = request.headers.get(CSRF_HEADER, "")
            if not hmac.compare_digest(sent.encode(), session.csrf.encode()):
                raise HTTPException(403, f"refused: a request made with the dashboard's session cookie must send "
                                         f"its CSRF token in the {CSRF_HEADER} header (a cross-site form post?)")
        return session.secret
