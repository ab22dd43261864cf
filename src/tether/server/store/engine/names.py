"""The engine's names shared by its modules: the dialects, the bounds, the one error, database targets."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from tether.errors import ServerError

Dialect = Literal["sqlite", "postgres"]
CONNECT_TIMEOUT_S = 10
STATEMENT_TIMEOUT_MS = 30_000
TOKENS_CHANNEL = "tether_tokens"  # NOTIFY'd by a trigger whenever a token is created, revoked or rescoped


class StoreUnavailable(ServerError, RuntimeError):
    """The state directory or database cannot be written or reached (full disk, read-only, unreachable)."""


def is_url(target: str | Path) -> bool:
    return isinstance(target, str) and target.split(":", 1)[0].lower() in ("postgresql", "postgres")


def safe_url(url: str) -> str:
    """The URL with its password masked: what may be printed or logged."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{netloc[-1]}"))


def describe(target: str | Path) -> str:
    return safe_url(str(target)) if is_url(target) else str(target)


def dialect_of(conn: Any) -> Dialect:
    return getattr(conn, "dialect", "sqlite")


def pick(migration: str | Mapping[str, str], dialect: Dialect) -> str:
    """A migration's text for this dialect: one text for both, or {"sqlite": …, "postgres": …}."""
    return migration if isinstance(migration, str) else migration[dialect]
