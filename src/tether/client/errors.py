"""What `tether.Client` and `tether.AsyncClient` raise; every one is a `tether.errors.ClientError`.

    ClientError                 (tether.errors)
    ├── HTTPStatusError         the server answered 4xx/5xx: `status`, and its `{"error": ...}` text as `message`
    ├── TransportError          the request did not complete (also a ConnectionError)
    │   ├── ConnectError        the server could not be reached (refused, no route, TLS or pin refused)
    │   └── RequestTimeout      no answer within the call's timeout (also a TimeoutError)
    └── IncompleteStream        a stream ended before its last event (results, summary or end)
"""

from __future__ import annotations

from tether.errors import ClientError

__all__ = ["ClientError", "ConnectError", "HTTPStatusError", "IncompleteStream", "RequestTimeout",
           "TransportError"]


class HTTPStatusError(ClientError):
    """The server refused the call. `status` is the HTTP status; `message` the server's own `error` text
    (or the start of its body when it sent no JSON); `str()` says both."""

    def __init__(self, status: int, message: str, method: str = "", path: str = "") -> None:
        where = f" to {method} {path}" if method else ""
        super().__init__(f"server answered {status}{where}: {message}")
        self.status = status
        self.message = message


class TransportError(ClientError, ConnectionError):
    """The request did not complete: the connection failed, dropped or timed out."""


class ConnectError(TransportError):
    """The server could not be reached at the client's base URL (refused, unresolvable, TLS refused)."""


class RequestTimeout(TransportError, TimeoutError):
    """The server did not answer within the call's timeout."""


class IncompleteStream(ClientError):
    """The server closed a streamed answer before its final event."""
