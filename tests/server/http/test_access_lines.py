"""The server's access lines: `logsafe.access_formatter` writes exactly what uvicorn's `AccessFormatter` writes
(uncoloured and coloured, every kind of status), and the access logger's records skip the caller lookup
without changing a line. What a peer can put into a line is tested as an attacker would in
tests/attacks/test_server_boundaries.py."""

from __future__ import annotations

import io
import logging
import logging.config

import pytest
from uvicorn.logging import AccessFormatter

from tether.server.http.logsafe import EscapeControlChars, access_formatter, server_log_config, skip_caller_lookup

FORMAT = server_log_config("info")["formatters"]["access"]["fmt"]
ACCESS = '%s - "%s %s HTTP/%s" %d'
LINES = [("127.0.0.1:5000", "POST", "/api/v1/devices/laptop/commands", "1.1", 200),
         ("10.0.0.2:1", "GET", "/api/v1/devices?x=1", "1.0", 404),
         ("[::1]:8", "DELETE", "/api/v1/batches/b", "1.1", 503),
         ("h:1", "GET", "/", "1.1", 599),  # no phrase
         ("h:1", "GET", "/", "1.1", 999)]  # outside HTTP's range


def record(args: tuple[object, ...], msg: str = ACCESS) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, msg, args, None)


@pytest.mark.parametrize("colours", [False, True])
def test_access_lines_are_uvicorns_text(colours: bool) -> None:
    ours, theirs = access_formatter(FORMAT, use_colors=colours), AccessFormatter(FORMAT, use_colors=colours)
    for args in [*LINES, *LINES]:  # twice: the second time from the phrases remembered
        assert ours.format(record(args)) == theirs.format(record(args))
    odd = record(("only", "two"), "%s %s")  # another shape: uvicorn's own formatter decides (and fails) the same
    with pytest.raises(ValueError):
        theirs.format(odd)
    with pytest.raises(ValueError):
        ours.format(record(("only", "two"), "%s %s"))


def test_escaped_access_lines_through_the_servers_logging_match_uvicorns() -> None:
    """Through the server's own filter and handler: a control character in a path is still escaped, the
    query string still dropped, and the line is the one uvicorn's formatter writes for the escaped record."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(EscapeControlChars())
    handler.setFormatter(access_formatter(FORMAT, use_colors=False))
    logger = logging.Logger("uvicorn.access")  # not the process's logger: nothing else sees it
    logger.addHandler(handler)
    skip_caller_lookup(logger)
    logger.info(ACCESS, "127.0.0.1:9", "GET", "/a\nINFO: forged?token=secret", "1.1", 200)
    logger.info(ACCESS, *LINES[0])
    first, second = stream.getvalue().splitlines()
    assert first == 'INFO:     127.0.0.1:9 - "GET /a\\nINFO: forged HTTP/1.1" 200 OK'
    assert second == AccessFormatter(FORMAT, use_colors=False).format(record(LINES[0]))
