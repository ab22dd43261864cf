"""The chunk commands of a transfer, sent through the hub without an audit row each.

A transfer is audited once per side, with its bytes, files and checksum (`service`); the control commands
(manifest, begin, commit) keep their own rows like any command. The chunks in between would add a row per
chunk (a 64 MiB file: 128 rows saying "a chunk") and the base64 payload to each row's arguments, so they
go through a dispatcher whose audit only answers whether the log can be written: a transfer whose audit
log cannot be written is not started, and one whose log fails midway stops at its next chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from tether.server.store.audit import AuditLog


class ChunkAudit:
    """The `BatchAudit` of chunk commands: `problem()` is the real log's, and the rows are not written."""

    def __init__(self, log: AuditLog) -> None:
        self.log = log

    def problem(self) -> str | None:
        return self.log.problem()

    def sent_grouped(self, rows: Iterable[tuple[Any, ...]]) -> asyncio.Future[str | None]:
        done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        done.set_result(self.log.problem())
        return done

    def done_grouped(self, outcomes: Iterable[tuple[str, str | None, str, str | None]]) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def done_queued(self, outcomes: Iterable[tuple[str, str | None, str, str | None]]) -> None:
        return None

    def done(self, outcomes: Iterable[tuple[str, str | None, str, str | None]]) -> None:
        return None

    def record_soon(self, rows: Iterable[tuple[Any, ...]]) -> None:
        return None

    def late(self, device: str, outcomes: list[tuple[str, str, str, str | None]],
             then: Callable[[int], None] | None = None) -> int | None:
        if then is not None:
            then(0)
        return 0
