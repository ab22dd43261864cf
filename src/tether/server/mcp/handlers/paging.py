"""Pagination of `/mcp`'s lists (`tools/list`, `resources/list`, `resources/templates/list`, `prompts/list`).

Each list is computed whole per request (the fleet is the token's own view of it, now) and handed out a page
at a time: at most `size` items, with an opaque `nextCursor` while more follow. A cursor is the list's method
and the offset of the next item, base64url-encoded; it is only good for the method that made it. Between
two pages the fleet may change (a device leaves or registers), so a client may see an item twice or miss one
that appeared meanwhile, as with any offset paginator; the list-changed notifications say when to list again.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from typing import Any, TypeVar

from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

T = TypeVar("T")
MAX_CURSOR = 200  # characters of a cursor worth decoding


def encode_cursor(method: str, offset: int) -> str:
    """The opaque cursor of `method`'s list from item `offset` on."""
    raw = json.dumps({"m": method, "o": offset}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(method: str, cursor: str | None) -> int:
    """The offset a cursor of `method` names (0 for none); MCPError INVALID_PARAMS (-32602) for a cursor this
    gateway did not give for `method`."""
    if cursor is None:
        return 0
    try:
        if len(cursor) > MAX_CURSOR:
            raise ValueError("too long")
        data = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        offset = data["o"] if isinstance(data, dict) and data.get("m") == method else None
        if type(offset) is not int or offset < 0:
            raise ValueError("not this list's")
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeDecodeError):
        raise MCPError(INVALID_PARAMS, f"invalid cursor for {method}: give the nextCursor of an earlier {method} "
                       "answer, or none for the first page") from None
    return offset


def page(method: str, items: Sequence[T], cursor: str | None, size: int) -> tuple[list[T], str | None]:
    """The page of `items` that `cursor` names (at most `size` items) and the next page's cursor, None on the
    last page; MCPError INVALID_PARAMS for an invalid cursor. A cursor past the end gives an empty last page
    (the list shrank since it was given)."""
    start = decode_cursor(method, cursor)
    end = start + size
    return list(items[start:end]), encode_cursor(method, end) if end < len(items) else None


def checked_cursor(params: Any, method: str | None = None) -> str | None:
    """The `cursor` of a request's params (None without params); with `method`, checked first (MCPError
    INVALID_PARAMS when it is not a cursor of `method`), so a bad one is refused before any work."""
    cursor = getattr(params, "cursor", None) if params is not None else None
    if method is not None:
        decode_cursor(method, cursor)
    return cursor
