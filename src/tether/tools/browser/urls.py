"""`check_url` and `needs_route`: which URLs the browser may open under a `Policy`.

The browser is the one tool that fetches what it is told to from anywhere, and a page can navigate by
itself, so the same judgement runs before a URL is opened and again wherever Chromium ended up. It
is plain string work with traps of its own (control characters browsers drop, backslashes Chromium
reads as slashes, default ports), so it lives apart from the session machinery, testable without a
browser.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from tether.tools.errors import PolicyDenied, ToolError
from tether.tools.policy.model import Policy

# schemes that never carry "//" but are real schemes, so "javascript:x" is refused, not "not absolute"
_KNOWN_SCHEMES = frozenset({"file", "javascript", "data", "chrome", "chrome-extension", "chrome-untrusted",
                            "devtools", "about", "blob", "filesystem", "view-source", "ftp", "ws", "wss", "mailto",
                            "tel", "intent", "vbscript", "http", "https"})
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443, "ftp": 21}


def check_url(policy: Policy, url: str) -> str:
    """`url` (stripped) if the policy lets the browser open it; else `PolicyDenied` naming the rule.

    Control characters are refused outright: browsers silently drop tabs and newlines from URLs, so
    `java\\tscript:` would otherwise pass a scheme check it should fail. A backslash in the authority is
    refused too, because Chromium reads it as a slash and Python does not (a host-confusion trick).
    """
    if not isinstance(url, str) or not url.strip():
        raise ToolError("url is required: give an absolute URL such as https://example.com")
    url = url.strip()
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        raise PolicyDenied("browser.url", f"{url!r} contains control characters")
    if url == "about:blank":
        return url
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if not scheme or ("://" not in url and scheme not in _KNOWN_SCHEMES):
        raise ToolError(f"{url!r} is not an absolute URL: give the scheme, e.g. https://{url}")
    schemes = [s.lower().rstrip(":") for s in policy.browser_allowed_schemes]
    if scheme not in schemes:
        raise PolicyDenied("browser.scheme", f"{scheme}: URLs are not allowed (browser_allowed_schemes: "
                                             f"{', '.join(schemes) or 'none'}; about:blank is always allowed)")
    if "\\" in parts.netloc:
        raise PolicyDenied("browser.url", f"{url!r} has a backslash in its host part")
    if policy.browser_allowed_origins:
        host = (parts.hostname or "").lower()
        try:
            port = parts.port or _DEFAULT_PORTS.get(scheme)
        except ValueError:
            raise PolicyDenied("browser.url", f"{url!r} has an invalid port") from None
        if not any(_origin_matches(entry, scheme, host, port) for entry in policy.browser_allowed_origins):
            origin = f"{scheme}://{host}" + (f":{port}" if port and port != _DEFAULT_PORTS.get(scheme) else "")
            raise PolicyDenied("browser.origin", f"{origin} is not in browser_allowed_origins "
                                                 f"({', '.join(policy.browser_allowed_origins)})")
    return url


def _origin_matches(entry: str, scheme: str, host: str, port: int | None) -> bool:
    """Whether an allowlist entry covers an origin. Entries: `*`; an origin `https://example.com[:port]`
    (the scheme's default port unless one is given); `https://*.example.com` (subdomains only); a bare host
    `example.com` or `example.com:8080` (any allowed scheme, any port unless one is given)."""
    entry = entry.strip().lower()
    if entry == "*":
        return True
    want_scheme, rest = entry.split("://", 1) if "://" in entry else (None, entry)
    if want_scheme is not None and want_scheme != scheme:
        return False
    parsed = urlsplit(f"{scheme}://{rest}")
    want_host = (parsed.hostname or "").lower()
    try:
        want_port = parsed.port or (_DEFAULT_PORTS.get(scheme) if want_scheme else None)
    except ValueError:
        return False
    if want_port is not None and want_port != port:
        return False
    if want_host.startswith("*."):
        return host.endswith(want_host[1:]) and host != want_host[2:]
    return host == want_host


def needs_route(policy: Policy) -> bool:
    """Whether page-started navigations must be intercepted (routing disables Chromium's HTTP cache,
    so it is switched on only when the policy restricts what http(s) pages may open)."""
    schemes = {s.lower() for s in policy.browser_allowed_schemes}
    return bool(policy.browser_allowed_origins) or not {"http", "https"} <= schemes
