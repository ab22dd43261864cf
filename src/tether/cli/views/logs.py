"""Log output for the long-running commands (`tether device`, `tether server`) that services run.

Plain lines (`LEVEL logger: message`, no timestamp: journald and `docker logs` add their own) or one
JSON object per line for log shippers, with the fields a record carries beyond the message (a
command's tool, caller, status and duration when the device logs one). Either way, control characters
in a message and its arguments are escaped (`tether.server.http.logsafe`): one call, one line, and nothing
in it drives a terminal.
"""

from __future__ import annotations

import io
import json
import logging
import time
from typing import Any

FORMATS = ("plain", "json")
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _PlainFormatter(logging.Formatter):
    """`LEVEL logger: message`: what `Formatter("%(levelname)s %(name)s: %(message)s")` writes, the common
    record (no exception, no stack) formatted without the style machinery; any other through it."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text or record.stack_info:
            return super().format(record)
        message = record.message = record.getMessage()
        return f"{record.levelname} {record.name}: {message}"


def _writes_through(stream: object) -> bool:
    """Whether each line written to `stream` is out when `write` returns: a line-buffered text stream
    (`sys.stderr` is one) or one writing through to an unbuffered file (`sys.stderr` with PYTHONUNBUFFERED)."""
    return bool(getattr(stream, "line_buffering", False)) or (
        getattr(stream, "write_through", False) and isinstance(getattr(stream, "buffer", None), io.RawIOBase))


class _LineHandler(logging.StreamHandler):
    """A `StreamHandler` whose `emit` flushes only a stream that does not write each line through itself
    (`_writes_through`): a device logs a line per command, and the flush took the lock a second time for
    nothing."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = self.stream
            stream.write(self.format(record) + self.terminator)
            if not _writes_through(stream):
                stream.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def configure(level: str = "info", fmt: str = "plain") -> None:
    """Replace the CLI's default (warnings, plain) with `level` and `fmt` for the whole process."""
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"--log-level must be debug, info, warning or error, not {level!r}")
    from tether.server.http.logsafe import EscapeControlChars  # standard library only: no server import cost

    handler = _LineHandler()
    handler.addFilter(EscapeControlChars())  # a server's or a tool's words in a line: its controls shown escaped
    handler.setFormatter(JsonFormatter() if fmt == "json" else _PlainFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    # no record carries its thread, process or the line that logged it: neither format shows them, and the
    # caller is found by walking the stack on every line (a device logs one per command): the switches the
    # logging HOWTO's "Optimization" section gives for this
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None
    for noisy in ("httpx", "httpcore", "websockets"):  # their info lines are per request: keep them quiet
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))
