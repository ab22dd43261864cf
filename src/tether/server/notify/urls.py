"""Where a webhook may point, and how its URL is shown (a Slack webhook's path is its secret)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit

from tether.errors import ServerError

MAX_URL = 2048


class WebhookRefused(ServerError, ValueError):
    """A webhook URL tether will not send to; `str()` says why. `status` is the HTTP answer where a person gave
    it: 400 not an http(s) URL, 403 a private address the server's settings forbid, 404 a host that does not
    resolve."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_webhook_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http or https URL with a host; `WebhookRefused` for anything else."""
    if not url or len(url) > MAX_URL:
        raise WebhookRefused(f"a webhook URL must be 1 to {MAX_URL} characters")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise WebhookRefused(f"not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise WebhookRefused(f"a webhook URL must start with http:// or https://, not {parts.scheme or 'nothing'}:")
    if not parts.hostname:
        raise WebhookRefused("a webhook URL must name a host")
    if parts.username or parts.password:
        raise WebhookRefused("a webhook URL may not carry a user name or password: the body is signed instead")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def private_reason(address: str) -> str | None:
    """Why this IP address is not one a webhook may reach by default (loopback, private, link-local, …), or None
    for a public address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for kind, flag in (("loopback", ip.is_loopback), ("link-local", ip.is_link_local),
                       ("unspecified", ip.is_unspecified), ("multicast", ip.is_multicast),
                       ("private", ip.is_private), ("reserved", ip.is_reserved)):
        if flag:
            return kind
    return None if ip.is_global else "non-global"  # shared address space (100.64.0.0/10, carrier NAT) and the like


async def resolve_webhook(url: str, allow_private: bool) -> str:
    """The one IP address a send to `url` connects to: its host's first address (an IP literal is itself).
    `WebhookRefused` when the URL is not http(s) (400), its host does not resolve (404), or, unless
    `allow_private`, any address it resolves to is not public (403)."""
    _, host, port = parse_webhook_url(url)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except UnicodeError:  # a label over 63 characters, or one IDNA cannot encode
        raise WebhookRefused(f"{host[:80]!r} is not a host name", 400) from None
    except OSError as exc:
        raise WebhookRefused(f"cannot resolve {host}: {exc.strerror or exc}", 404) from None
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        raise WebhookRefused(f"cannot resolve {host}: no address", 404)
    if not allow_private:
        for address in addresses:
            reason = private_reason(address)
            if reason is not None:
                raise WebhookRefused(f"{host} resolves to {address}, a {reason} address: webhooks go to public "
                                     "addresses unless the server's webhook_allow_private setting is on "
                                     "(`tether server --set webhook_allow_private=true`)", 403)
    return addresses[0]


async def check_webhook_url(url: str, allow_private: bool) -> None:
    """`WebhookRefused` unless `url` is http(s) and, unless `allow_private`, every address its host resolves
    to is public (`resolve_webhook`). Checked when a webhook is added; a send resolves once more and connects
    to the address it checked (`pinning.pinned_client`)."""
    parse_webhook_url(url)
    if not allow_private:
        await resolve_webhook(url, allow_private)


def redact(url: str) -> str:
    """The URL as listings and logs show it: scheme, host, port and the path's first segment, the rest
    (a Slack webhook's secret, a query's token) replaced by '…'."""
    try:
        parts = urlsplit(url)
        netloc = parts.hostname or "?"
        if parts.port:
            netloc = f"{netloc}:{parts.port}"
    except ValueError:
        return "(an invalid URL)"
    segments = [s for s in parts.path.split("/") if s]
    shown = f"/{segments[0]}" if segments else ""
    hidden = len(segments) > 1 or parts.query or parts.fragment
    return f"{parts.scheme}://{netloc}{shown}{'/…' if hidden else ''}"
