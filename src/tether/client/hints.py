"""`Hints`: where a cluster's nodes said a call is best sent (the `X-Tether-Holder` header, docs/scaling.md).

Shared by `Client`, `AsyncClient` and the CLI's `RemoteServer`; no I/O here.
"""

from __future__ import annotations

from typing import Any

HOLDER_HEADER = "x-tether-holder"  # a cluster node's hint: the API URL of the node holding the device
MAX_HINTS = 10_000


class Hints:
    """Where a cluster's nodes said a call is best sent: a node that does not hold a device answers a command
    for it with `X-Tether-Holder` (the holding node's base URL), and the client sends that path's next calls
    there, skipping a hop between nodes. A hint never leaves TLS (from an https base only https hints are
    taken); a hinted node that cannot be reached is forgotten and the call is sent to `base` again (nothing
    was sent then). The holding node sends no hint, so a path keeps its node until a call is hinted anew."""

    def __init__(self, base: str) -> None:
        self.base = base
        self._nodes: dict[str, str] = {}  # path -> a node's base URL

    def url(self, path: str) -> str:
        """The URL to send a call of `path` to: the hinted node's, else `path` (under the client's base)."""
        node = self._nodes.get(path)
        return node + path if node is not None else path

    def hinted(self, path: str) -> bool:
        """Whether a call of `path` goes to a hinted node."""
        return path in self._nodes

    def learn(self, path: str, response: Any) -> None:
        """Take the hint of `response` (an httpx response to a call of `path`), if it carries one this client
        may follow."""
        hint = response.headers.get(HOLDER_HEADER)
        if not hint:
            return
        hint = hint.rstrip("/")
        if not hint.startswith(("https://", "http://")) or (self.base.startswith("https://")
                                                           and not hint.startswith("https://")):
            return
        if hint == self.base:
            self._nodes.pop(path, None)
        elif path in self._nodes or len(self._nodes) < MAX_HINTS:
            self._nodes[path] = hint

    def forget(self, path: str) -> None:
        """Send calls of `path` to the base URL again (its hinted node was unreachable)."""
        self._nodes.pop(path, None)
