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

from tether.printable import CONTROL, printable
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


def _plain(args: tuple[Any, ...]) -> bool:
    """Whether every argument is text without a control character, a number or None: nothing to escape (an
    access line's, one search for its four texts instead of one call and search each)."""
    texts = []
    for value in args:
        kind = type(value)
        if kind is str:
            texts.append(value)
        elif value is not None and kind is not int and kind is not float:
            return False
    return CONTROL.search(" ".join(texts)) is None


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
            safe = list(args) if _plain(args) else [_safe_arg(a) for a in args]
            # an access line's args: (client, method, path?query, version, status)
            if record.name == internals.ACCESS_LOGGER and len(safe) == 5:
                safe[2] = _without_query(safe[2])
            elif isinstance(message, str) and message.startswith(internals.WEBSOCKET_LINE) and len(safe) >= 2:
                safe[1] = _without_query(safe[1])
            record.args = tuple(safe)
        elif isinstance(args, Mapping):
            record.args = {key: _safe_arg(value) for key, value in args.items()}
        return True


class _Fields:
    """What `logging.Formatter.formatMessage` reads of a record (its `__dict__`), made from given values."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__ = values


def access_formatter(fmt: str | None = None, datefmt: str | None = None, style: str = "%",
                     use_colors: bool | None = None) -> logging.Formatter:
    """uvicorn's formatter of its access lines (`uvicorn.logging.AccessFormatter`, built with these arguments) with
    the same text, made cheaper for the uncoloured lines a service writes: uvicorn's copies each record twice
    (`copy.copy`, its formatter and its base's) and looks the status phrase up in `HTTPStatus` for every
    line — together ~5% of the server's CPU per REST command at the default level, info. Coloured lines (a
    terminal) and records of another shape are uvicorn's own. `logging.config.dictConfig` builds it (`"()"`)."""
    import http

    from uvicorn.logging import AccessFormatter

    class AccessLines(AccessFormatter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.statuses: dict[int, str] = {}  # status code -> "200 OK", as uvicorn writes it uncoloured

        def formatMessage(self, record: logging.LogRecord) -> str:
            args = record.args
            values = record.__dict__
            if self.use_colors or type(args) is not tuple or len(args) != 5 or "color_message" in values:
                return super().formatMessage(record)
            client_addr, method, full_path, http_version, code = args
            if type(code) is not int:
                return super().formatMessage(record)
            status = self.statuses.get(code)
            if status is None:
                try:
                    status = f"{code} {http.HTTPStatus(code).phrase}"
                except ValueError:
                    status = f"{code} "
                if 100 <= code < 600:
                    self.statuses[code] = status
            fields = dict(values)
            fields["levelprefix"] = record.levelname + ":" + " " * (8 - len(record.levelname))
            fields["client_addr"] = client_addr
            fields["request_line"] = f"{method} {full_path} HTTP/{http_version}"
            fields["status_code"] = status
            return logging.Formatter.formatMessage(self, _Fields(fields))  # type: ignore[arg-type]

    return AccessLines(fmt, datefmt, style, use_colors)


def _no_caller(stack_info: bool = False, stacklevel: int = 1) -> tuple[str, int, str, None]:
    return "(unknown file)", 0, "(unknown function)", None  # what logging records when it does not look


def skip_caller_lookup(logger: logging.Logger) -> None:
    """`logger`'s records are made without looking up their caller: logging's `findCaller` walks the stack
    for the file, line and function of each call (~7 µs), which no format of the server's shows. For uvicorn's
    access logger, one record per request (`server_log_config` formats its lines without them)."""
    logger.findCaller = _no_caller  # type: ignore[method-assign]


_LEVELS = {"critical", "error", "warning", "info", "debug"}


def server_log_config(log_level: str = "info") -> dict[str, Any]:
    """The `logging.config.dictConfig` set-up for uvicorn running the agent server."""
    config = internals.uvicorn_logging_config()
    config["filters"] = {"escape": {"()": f"{__name__}.EscapeControlChars"}}
    config["formatters"]["access"]["()"] = f"{__name__}.access_formatter"  # uvicorn's lines, cheaper
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
