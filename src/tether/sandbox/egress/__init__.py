"""The egress proxy: the one way out of a sandbox whose network is private.

`proxy` (EgressProxy: judges, resolves, connects, relays and records each connection), `rules`
(EgressRules: the allow/deny lists and the address checks), `handshake` (the request heads it reads:
HTTP CONNECT, HTTP forward, SOCKS5; the refusals it writes), `relay` (bytes both ways, spliced),
`owner` (which sandboxed command holds a connecting socket) and `live` (the proxy for a live process,
such as a sandboxed MCP server). Import the modules themselves: this file imports nothing.
"""
