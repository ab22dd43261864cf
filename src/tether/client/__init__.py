"""Talking to a tether server from Python: `Client` (sync) and `AsyncClient` (asyncio), their answers'
models and their errors; `rest.RemoteServer` is the CLI's low-level transport. Names load lazily."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tether.imports import lazy_import

__all__ = ["AsyncClient", "AuditPage", "BatchResults", "Client", "ClientError", "ConnectError", "Device",
           "DeviceDetail", "FanOutOutcome", "FanOutReport", "FanOutSummary", "HTTPStatusError", "IncompleteStream",
           "RequestTimeout", "TaskEnd", "TaskSummary", "TransportError"]

if TYPE_CHECKING:
    from tether.client.aio import AsyncClient
    from tether.client.errors import (
        ClientError,
        ConnectError,
        HTTPStatusError,
        IncompleteStream,
        RequestTimeout,
        TransportError,
    )
    from tether.client.responses import (
        AuditPage,
        BatchResults,
        Device,
        DeviceDetail,
        FanOutOutcome,
        FanOutReport,
        FanOutSummary,
        TaskEnd,
        TaskSummary,
    )
    from tether.client.sync import Client
else:
    _ERRORS = "tether.client.errors"
    _MODELS = "tether.client.responses"
    __getattr__, __dir__ = lazy_import(globals(), {
        "AsyncClient": "tether.client.aio", "Client": "tether.client.sync",
        **dict.fromkeys(["ClientError", "ConnectError", "HTTPStatusError", "IncompleteStream", "RequestTimeout",
                         "TransportError"], _ERRORS),
        **dict.fromkeys(["AuditPage", "BatchResults", "Device", "DeviceDetail", "FanOutOutcome", "FanOutReport",
                         "FanOutSummary", "TaskEnd", "TaskSummary"], _MODELS)})
