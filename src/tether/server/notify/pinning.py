"""A webhook send goes to the address that was checked, not to whatever the name resolves to a moment later.

`urls.resolve_webhook` resolves the URL's host once and (unless the server's `webhook_allow_private`) refuses it when
any address is loopback, private, link-local, …; `pinned_client` then connects to exactly the chosen address,
while the request keeps the URL's host: the `Host` header, TLS's SNI and the certificate check are the name's.
So a name that answers a public address to the check and a loopback one to the connection (DNS rebinding) never
reaches the loopback one: there is no second lookup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx


def pinned_client(url: str, address: str, timeout: float) -> httpx.AsyncClient:
    """An httpx client whose only connections go to `address` (the port from the URL) for requests to `url`'s
    host; a request to any other host fails to connect. No redirects, no proxy variables."""
    import httpcore
    import httpx

    class PinnedBackend(httpcore.AsyncNetworkBackend):
        """Connects to the pinned address whatever the name resolves to now; the TLS layer above it still
        speaks the URL's host name (SNI, certificate)."""

        def __init__(self, host: str) -> None:
            self.host = host
            self.inner = httpcore.AnyIOBackend()

        async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                              local_address: str | None = None, socket_options: Any = None,
                              ) -> httpcore.AsyncNetworkStream:
            if host.lower() != self.host:
                raise httpcore.ConnectError(f"a webhook connection goes to its own host only, not {host[:80]!r}")
            return await self.inner.connect_tcp(address, port, timeout, local_address, socket_options)

        async def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None,
                                      ) -> httpcore.AsyncNetworkStream:
            raise httpcore.ConnectError("a webhook never goes to a unix socket")

        async def sleep(self, seconds: float) -> None:
            await self.inner.sleep(seconds)

    class PinnedTransport(httpx.AsyncHTTPTransport):
        def __init__(self, host: str) -> None:
            super().__init__(trust_env=False)
            self._pool = httpcore.AsyncConnectionPool(ssl_context=httpx.create_ssl_context(trust_env=False),
                                                      network_backend=PinnedBackend(host))

    return httpx.AsyncClient(transport=PinnedTransport(httpx.URL(url).host.lower()), timeout=httpx.Timeout(timeout),
                             follow_redirects=False, trust_env=False)

