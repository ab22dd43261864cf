"""Log lines a peer cannot forge, and an access log that never records a query string.

Device names, ERROR frame texts, tool names, client ids, paths and headers all come from the
other end of a socket. Written into a log as they are, a `\\n` in one of them starts a line the
reader takes for the server's own ("device … registered"), and an ESC sequence rewrites the
terminal it is shown in. `clean` escapes every control character (C0, DEL, C1, the Unicode
line and paragraph separators, and the bidi overrides and marks) so one log call stays one line;
`EscapeControlChars` applies it to every record a handler of the server's logging writes — the
message and each of its arguments — so no call site can forget it. Tracebacks keep their lines.

uvicorn logs the request target with its query string (`GET /api/v1/devices?token=…`); a token
put there by mistake would land in the log. The same filter cuts the query string off uvicorn's
access lines and its WebSocket lines. `server_log_config` is the logging set-up `tether server`
gives uvicorn: uvicorn's own handlers and formats, this filter on each handler, and the `tether`
loggers written beside uvicorn's at the chosen level.

uvicorn's default WebSocket implementation (websockets-sansio, 0.54) logs "ASGI callable returned
without completing handshake." at ERROR after every handshake refused with a denial response,
although the refusal went out as intended (Kludex/uvicorn PR #3138). The server refuses every
handshake without a valid device token that way, so the filter drops that line when — and only
when — the app refused the handshake in that same task (`mark_denied_handshake`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from tether.printable import printable
from tether.server.http import internals

_denied_handshake: ContextVar[bool] = ContextVar("tether_denied_handshake", default=False)


def mark_denied_handshake() -> None:
    """Note that this task's WebSocket handshake was refused on purpose (see the module docstring)."""
    _denied_handshake.set(True)

def clean(value: object) -> str:
    """`value` as text with every control character escaped (`\\n`, `\\r`, `\\t`, `\\x1b`, `\\u2028`…)."""
    return printable(value)


class _Escaped:
    """An argument that is neither text nor a number: formatted by `%s` or `%r`, then escaped."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:
        return clean(str(self.value))

    def __repr__(self) -> str:
        return clean(repr(self.value))


def _safe_arg(value: Any) -> Any:
    if isinstance(value, str):
        return value if value.isprintable() else clean(value)  # the common argument: nothing to escape
    if value is None or isinstance(value, (int, float)):
        return value
    return _Escaped(value)


def _without_query(value: Any) -> Any:
    return value.split("?", 1)[0] if isinstance(value, str) else value


class EscapeControlChars(logging.Filter):
    """A handler filter: escape control characters in the message and its arguments; drop query
    strings from uvicorn's access and WebSocket lines. Idempotent (a record may pass two handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_tether_escaped", False):
            return True
        if record.msg == internals.SPURIOUS_HANDSHAKE_ERROR and record.name == internals.ERROR_LOGGER \
                and _denied_handshake.get():
            return False
        record._tether_escaped = True
        message = record.msg
        if isinstance(message, str):
            record.msg = clean(message)
        args = record.args
        if isinstance(args, tuple) and args:
            safe = [_safe_arg(a) for a in args]
            # an access line's args: (client, method, path?query, version, status)
            if record.name == internals.ACCESS_LOGGER and len(safe) == 5:
                safe[2] = _without_query(safe[2])
            elif isinstance(message, str) and message.startswith(internals.WEBSOCKET_LINE) and len(safe) >= 2:
                safe[1] = _without_query(safe[1])
            record.args = tuple(safe)
        elif isinstance(args, Mapping):
            record.args = {key: _safe_arg(value) for key, value in args.items()}
        return True


_LEVELS = {"critical", "error", "warning", "info", "debug"}


def server_log_config(log_level: str = "info") -> dict[str, Any]:
    """The `logging.config.dictConfig` set-up for uvicorn running the agent server."""
    config = internals.uvicorn_logging_config()
    config["filters"] = {"escape": {"()": f"{__name__}.EscapeControlChars"}}
    config["formatters"]["tether"] = {"()": internals.DEFAULT_FORMATTER,
                                      "fmt": "%(levelprefix)s %(name)s: %(message)s", "use_colors": None}
    for handler in config["handlers"].values():
        handler["filters"] = ["escape"]
    config["handlers"]["tether"] = {"formatter": "tether", "class": "logging.StreamHandler",
                                    "stream": "ext://sys.stderr", "filters": ["escape"]}
    level = log_level.lower()
    config["loggers"]["tether"] = {"handlers": ["tether"], "propagate": False,
                                   "level": level.upper() if level in _LEVELS else "DEBUG"}
    # every other library's lines (asyncio, websockets, httpx…) through the same filter, not Python's
    # unfiltered last-resort handler (or the CLI's basicConfig one, which this replaces)
    config["root"] = {"handlers": ["tether"], "level": "WARNING"}
    return config
