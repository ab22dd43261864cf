"""`tether.cli.views.logs`: a service's log line is in its file as soon as it is logged, whatever the stream's
buffering."""

from __future__ import annotations

import io
import logging
from pathlib import Path

from tether.cli.views.logs import _LineHandler


def test_each_line_is_out_when_logged_with_any_buffering(tmp_path: Path) -> None:
    def streams() -> list[tuple[str, io.TextIOBase]]:
        raw = io.FileIO(tmp_path / "unbuffered", "w")  # sys.stderr under PYTHONUNBUFFERED
        return [("line", (tmp_path / "line").open("w", buffering=1)),  # sys.stderr otherwise
                ("block", (tmp_path / "block").open("w")),  # a file: flushed by the handler
                ("unbuffered", io.TextIOWrapper(raw, write_through=True))]

    for name, stream in streams():
        logger = logging.getLogger(f"tests.cli.logs.{name}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        handler = _LineHandler(stream)
        logger.addHandler(handler)
        try:
            logger.info("command %s: %s", "list_tools", "success")
            assert (tmp_path / name).read_text() == "command list_tools: success\n", name
        finally:
            logger.removeHandler(handler)
            stream.close()


def test_plain_lines_are_the_stock_formatters() -> None:
    from tether.cli.views.logs import _PlainFormatter

    stock, plain = logging.Formatter("%(levelname)s %(name)s: %(message)s"), _PlainFormatter()
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        exc_info = sys.exc_info()
    records = [logging.LogRecord("tether.device.router", logging.INFO, "", 0, "command %s: %s in %.0f ms",
                                 ("list_tools", "success", 1.25), None),
               logging.LogRecord("x", logging.WARNING, "", 0, "no args %s", None, None),
               logging.LogRecord("x", logging.ERROR, "", 0, "failed: %s", ("it",), exc_info),
               logging.LogRecord("x", logging.INFO, "", 0, "with a stack", None, None, sinfo="Stack (most recent)")]
    for record in records:
        assert plain.format(record) == stock.format(record)
