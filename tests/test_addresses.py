"""The one loopback check (`tether.addresses.is_loopback`) and the places that decide by it: the server's bind
(`ServerSettings.loopback`), an OIDC issuer's plain-http URL, the tools' own MCP endpoint."""

from __future__ import annotations

import asyncio

import pytest

from tether.addresses import is_loopback
from tether.server.settings import ServerSettings
from tether.server.trust.oidc.config import is_loopback_url


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.0.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LocalHost", True), (" 127.0.0.1 ", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("example.com", False), ("", False),
    ("localhost.example.com", False), ("127.0.0.1.nip.io", False), ("::ffff:10.0.0.1", False),
])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    assert ServerSettings(host=host or "0.0.0.0").loopback is (loopback and bool(host))


@pytest.mark.parametrize("url, loopback", [
    ("http://localhost:9000/realms/x", True), ("http://LOCALHOST/", True), ("http://[::1]:8080/", True),
    ("http://127.0.0.5/", True), ("http://127.0.0.1.evil.example/", False), ("http://user@evil.example/", False),
    ("http://10.0.0.1/", False), ("http:///nohost", False),
])
def test_an_issuer_url_is_loopback_by_its_host_alone(url: str, loopback: bool) -> None:
    assert is_loopback_url(url) is loopback


def test_the_tools_endpoint_refuses_an_exposed_address_before_binding() -> None:
    from tether.tools.context import ToolContext
    from tether.tools.policy.model import default_policy
    from tether.tools.toolsets.builtin import builtin_toolsets
    from tether.tools.toolsets.mcp_export import serve_http, toolset_to_mcp

    server = toolset_to_mcp(builtin_toolsets()["system"](), lambda: ToolContext(policy=default_policy()))
    with pytest.raises(ValueError, match=r"refusing to serve tools on 0\.0\.0\.0: not a loopback address"):
        asyncio.run(serve_http(server, "0.0.0.0", 1))
