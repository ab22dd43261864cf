"""Server-sent events as (event, JSON data) pairs, from the lines of a streamed answer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

__all__ = ["SSEParser", "aiter_sse", "iter_sse"]


class SSEParser:
    """Feed lines (without their newline); `feed` returns a finished (event, data) pair or None.
    Comment lines (`: keep-alive`) are skipped; `data` is the JSON of the event's data lines."""

    def __init__(self) -> None:
        self._event = "message"
        self._data: list[str] = []

    def feed(self, line: str) -> tuple[str, Any] | None:
        if not line:
            event, data = self._event, self._data
            self._event, self._data = "message", []
            return (event, json.loads("\n".join(data))) if data else None
        if line.startswith("event:"):
            self._event = line[6:].strip()
        elif line.startswith("data:"):
            self._data.append(line[5:].lstrip())
        return None


def iter_sse(lines: Iterator[str]) -> Iterator[tuple[str, Any]]:
    """Each event of `lines` as (event name, decoded JSON data)."""
    parser = SSEParser()
    for line in lines:
        if (item := parser.feed(line)) is not None:
            yield item


async def aiter_sse(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, Any]]:
    """`iter_sse` for an async stream of lines."""
    parser = SSEParser()
    async for line in lines:
        if (item := parser.feed(line)) is not None:
            yield item
