"""`ToolPool`: one copy of each distinct tool list among the devices the server holds.

A fleet is mostly the same few builds: a profile with 14 tool schemas is ~70 KiB of Python objects,
and ten thousand devices reporting the same 14 tools would hold ten thousand identical copies. The
pool keys a tool list by the hash of its canonical JSON and hands every device with that content the
same list object, counting holders so the copy goes when its last holder lets go (a profile replaced,
a record forgotten). The shared lists are never mutated: a device whose tools change gets a new one.
"""

from __future__ import annotations

import hashlib
from typing import Any

from tether.protocol.models import ToolInfo


def _adapter() -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(list[ToolInfo])


class ToolPool:
    """Interned tool lists by content digest, with holder counts."""

    def __init__(self) -> None:
        self._lists: dict[str, list[ToolInfo]] = {}
        self._holders: dict[str, int] = {}
        self._codec: Any = None  # the list[ToolInfo] TypeAdapter, built on first use

    def __len__(self) -> int:
        return len(self._lists)

    @property
    def codec(self) -> Any:
        if self._codec is None:
            self._codec = _adapter()
        return self._codec

    def dump(self, tools: list[ToolInfo]) -> bytes:
        """The canonical JSON of `tools` (what is hashed, and what the store keeps once per digest)."""
        return bytes(self.codec.dump_json(tools))

    def digest(self, tools: list[ToolInfo]) -> str:
        return hashlib.sha256(self.dump(tools)).hexdigest()[:32]

    def intern(self, tools: list[ToolInfo]) -> tuple[str, list[ToolInfo]]:
        """The digest and the shared list equal to `tools`, counted as one more holder."""
        digest = self.digest(tools)
        return digest, self.acquire(digest, tools)

    def acquire(self, digest: str, tools: list[ToolInfo] | None = None) -> list[ToolInfo]:
        """One more holder of `digest`'s list; `tools` is that list's content when the pool lacks it."""
        shared = self._lists.get(digest)
        if shared is None:
            if tools is None:
                raise KeyError(digest)
            shared = self._lists[digest] = list(tools)
            self._holders[digest] = 0
        self._holders[digest] += 1
        return shared

    def get(self, digest: str) -> list[ToolInfo] | None:
        return self._lists.get(digest)

    def holders(self, digest: str) -> int:
        return self._holders.get(digest, 0)

    def release(self, digest: str) -> None:
        """One holder fewer; the list is dropped with its last holder."""
        left = self._holders.get(digest, 0) - 1
        if left > 0:
            self._holders[digest] = left
        else:
            self._holders.pop(digest, None)
            self._lists.pop(digest, None)
