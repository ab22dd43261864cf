"""Reading a server-sent event stream of the REST API (a command's events and results, a task's events, the
dashboard's fleet): each `data:` line decoded from JSON, under the name of the last `event:` line."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any


class _Lines:
    """One stream's lines read in order: the event name stands until the next `event:` line."""

    def __init__(self) -> None:
        self.name = ""

    def read(self, line: str) -> tuple[str, Any] | None:
        if line.startswith("event: "):
            self.name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            return self.name, json.loads(line.removeprefix("data: "))
        return None


def sse_events(lines: Iterable[str]) -> Iterator[tuple[str, Any]]:
    """(event name, data) for each `data: …` line of `lines` (`response.iter_lines()`); the name is "" before
    the first `event:` line. Data that is not JSON raises (every stream of the API sends JSON)."""
    stream = _Lines()
    for line in lines:
        if (event := stream.read(line)) is not None:
            yield event


async def async_sse_events(lines: AsyncIterable[str]) -> AsyncIterator[tuple[str, Any]]:
    """`sse_events` of `response.aiter_lines()`."""
    stream = _Lines()
    async for line in lines:
        if (event := stream.read(line)) is not None:
            yield event
