"""`HostRules`: which names a request may use in `Host` and `Origin` (DNS rebinding, cross-site pages)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable
from typing import Any

from tether.server.http.logsafe import clean
from tether.server.http.request_guard.answers import deny_websocket, send_error
from tether.server.http.request_guard.requests import Message, Scope
from tether.server.settings import DEFAULT_PORTS, Origin, is_ip, normalize_host, parse_origin

logger = logging.getLogger(__package__)

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
_VERDICTS_KEPT = 256
WILDCARDS = ("0.0.0.0", "::", "")  # noqa: S104 (names of the wildcard binds, not a bind)


class HostRules:
    """Which host names a request may use in `Host` and `Origin`."""

    def __init__(self, bind_host: str, extra: Iterable[str] = (), origins: Iterable[str] = ()) -> None:
        self.any = False
        self.names: set[str] = set(LOCAL_NAMES)
        # (Host, Origin, scheme) -> the verdict: a server sees few distinct ones, and working one out
        # (normalising the name, scanning its characters) was ~3% of the server's CPU per REST command
        self._verdicts: dict[tuple[bytes | None, bytes | None, str], str | None] = {}
        self.suffixes: list[str] = []
        self.listed: set[str] = set()  # names the operator listed: origins on their default ports too
        self.listed_suffixes: list[str] = []
        self.origins: set[Origin] = {o for o in map(parse_origin, origins) if o is not None}
        bind = bind_host.strip().strip("[]").lower()
        # Bound to every interface, the server is reached by addresses and names it cannot list
        # here. An IP literal cannot be re-pointed by DNS, so any address is accepted then; names
        # still have to be allowed (the machine's own host name is).
        self.any_ip = bind in WILDCARDS
        if self.any_ip:
            self.names.add(socket.gethostname().lower())
        elif bind:
            self.names.add(bind)
        for entry in extra:
            entry = entry.strip().lower()
            if entry == "*":
                self.any = True
            elif entry.startswith("*."):
                self.suffixes.append(entry[1:].rstrip("."))
                self.listed_suffixes.append(entry[1:].rstrip("."))
            elif (host := normalize_host(entry)) is not None:
                self.names.add(host)
                self.listed.add(host)

    def allows(self, host: str | None) -> bool:
        if self.any:
            return True
        if host is None:
            return False
        if host in self.names or any(host.endswith(s) for s in self.suffixes):
            return True
        return self.any_ip and is_ip(host)

    def check(self, headers: dict[bytes, bytes], raw: Iterable[tuple[bytes, bytes]] = (),
              scheme: str = "http") -> str | None:
        """Why these request headers are refused, or None. `raw` (all header pairs) is looked at for
        repeated Host or Origin headers, which are refused: parts of a stack may read different ones.
        `scheme` is the request's (the ASGI scope's: http, https, ws or wss)."""
        if self.any:
            return None
        if not isinstance(raw, (list, tuple)) or len(raw) > len(headers):  # some header repeats: which?
            names = [name for name, _ in raw if name in (b"host", b"origin")]
            if names.count(b"host") > 1 or names.count(b"origin") > 1:
                return "refused: the request repeats its Host or Origin header"
        key = (headers.get(b"host"), headers.get(b"origin"), scheme)
        try:
            return self._verdicts[key]
        except KeyError:
            pass
        verdict = self._verdict(*key)
        if len(self._verdicts) >= _VERDICTS_KEPT:  # names an attacker makes up cannot grow it
            self._verdicts.clear()
        self._verdicts[key] = verdict
        return verdict

    def _verdict(self, raw_host: bytes | None, origin: bytes | None, scheme: str) -> str | None:
        if raw_host is None:
            return "refused: the request has no Host header"
        host = normalize_host(raw_host.decode("latin-1"))
        if not self.allows(host):
            return (f"refused: Host {clean(raw_host.decode('latin-1'))!r} is not an allowed name for this "
                    "server (DNS rebinding?); an operator can allow it with 'tether server --allowed-host NAME' "
                    "or the server setting allowed_hosts")
        if origin is not None:
            text = origin.decode("latin-1").strip()
            if not self.origin_allowed(parse_origin(text), raw_host.decode("latin-1"), scheme):
                return (f"refused: cross-site request from Origin {clean(text)!r}; only pages of this server's "
                        "own origin (scheme, host and port) may call it; an operator can allow another with "
                        "the server setting allowed_origins")
        return None

    def origin_allowed(self, origin: Origin | None, raw_host: str, scheme: str) -> bool:
        """Whether a page of `origin` may call this server through a request with this `Host` and `scheme`:
        the same origin, or one the operator allowed (see the module docstring)."""
        if origin is None:
            return False
        if origin in self.origins:
            return True
        own_scheme = "https" if scheme in ("https", "wss") else "http"
        host = normalize_host(raw_host)
        port = _host_port(raw_host)
        same_host = origin[1] == host or (origin[1] in LOCAL_NAMES and host in LOCAL_NAMES)  # one machine
        if same_host and origin[0] == own_scheme and origin[2] == (DEFAULT_PORTS[own_scheme] if port is None else port):
            return True
        name = origin[1]
        listed = name in self.listed or any(name.endswith(s) for s in self.listed_suffixes)
        return listed and origin[2] == DEFAULT_PORTS[origin[0]]

    async def refused(self, scope: Scope, send: Callable[[Message], Any],
                      headers: dict[bytes, bytes] | None = None) -> bool:
        """True when these rules refuse the request, answered (403 `{"error": …}`) and logged. For the AIP
        WebSocket this is the whole guard: front.py then runs the socket with no guard frame around it
        for the socket's life."""
        raw = scope.get("headers") or ()
        headers = dict(raw) if headers is None else headers
        refusal = self.check(headers, raw, scope.get("scheme", "http"))
        if refusal is None:
            return False
        await self.refuse(scope, send, refusal, headers)
        return True

    async def refuse(self, scope: Scope, send: Callable[[Message], Any], refusal: str,
                     headers: dict[bytes, bytes], receive: Callable[[], Any] | None = None) -> None:
        """Answer (and log) a request `check` refused."""
        kind = scope["type"]
        client = scope.get("client")
        logger.warning("refused %s %s from %s: %s", "WebSocket" if kind == "websocket" else scope.get("method"),
                       scope.get("path"), f"{client[0]}:{client[1]}" if client else None, refusal)
        if kind == "websocket":
            await deny_websocket(scope, send, 403, refusal)
        else:
            await send_error(send, 403, refusal, receive=receive, headers=headers)


def _host_port(raw_host: str) -> int | None:
    """The port a `Host` value names, or None when it names none."""
    value = raw_host.strip()
    tail = value[value.find("]") + 1:] if value.startswith("[") else value
    if tail.count(":") != 1:
        return None
    port = tail.rpartition(":")[2]
    return int(port) if port.isdigit() else None
