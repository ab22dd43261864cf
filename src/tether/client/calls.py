"""Request building and answer decoding shared by `Client` and `AsyncClient`: no I/O here.

Each REST call is a `Call`: method, path, query, body, its timeout, and `parse`, which turns the decoded
JSON into the typed answer. A streamed call is a `StreamCall`, whose `item` turns one server-sent event
into what the stream yields and says when the stream is over. The two clients only send these.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import TypeAdapter

from tether.agent.run.task import Task, TaskEvent
from tether.client.errors import ConnectError, HTTPStatusError, RequestTimeout, TransportError
from tether.client.responses import (
    AuditPage,
    BatchResults,
    Device,
    DeviceDetail,
    FanOutOutcome,
    FanOutSummary,
    TaskEnd,
    TaskSummary,
)
from tether.protocol.messages import Event
from tether.protocol.models import Command, Result, ToolInfo
from tether.protocol.profile import DeviceRequirements

T = TypeVar("T")

API = "/api/v1"
SSE = "text/event-stream"
CONNECT_S = 10.0  # the connect part of every timeout
STREAM_SLACK_S = 30.0  # a streamed batch's read timeout: its own timeout plus this


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request and how to read its answer."""

    method: str
    path: str
    parse: Callable[[Any], T]
    params: dict[str, Any] | None = None
    json: Any = None
    timeout: float | None = None  # the client's own when None


@dataclass(frozen=True, slots=True)
class StreamCall(Generic[T]):
    """One request whose answer is server-sent events. `item(event, data)` returns what the stream yields for
    that event (None: skipped) and whether it was the last one."""

    method: str
    path: str
    item: Callable[[str, Any], tuple[T | None, bool]]
    timeout: float
    params: dict[str, Any] | None = None
    json: Any = None
    headers: dict[str, str] = field(default_factory=lambda: {"Accept": SSE})


def base_url(url: str) -> str:
    """The server's base URL over HTTP: `ws(s)://host:port/aip` (a device's URL) works too."""
    url = url.rstrip("/")
    if url.startswith(("ws://", "wss://")):
        url = "http" + url[2:].removesuffix("/aip")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"not a tether server URL: {url!r} (http://HOST:PORT or https://HOST:PORT)")
    return url


def headers(token: str | None) -> dict[str, str]:
    """The token goes in the Authorization header, never in a URL."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def verify_context(verify: bool | str | ssl.SSLContext) -> bool | ssl.SSLContext:
    """httpx's `verify`: True (the system's CAs), False, a CA file path, or a context as given."""
    return ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify


def timeout(seconds: float) -> httpx.Timeout:
    return httpx.Timeout(seconds, connect=min(seconds, CONNECT_S))


def part(text: str) -> str:
    """One path segment, quoted."""
    return quote(text, safe="")


# -- answers -------------------------------------------------------------------------------------------------

def decoded(response: httpx.Response, method: str, path: str) -> Any:
    """The JSON body of a successful answer; `HTTPStatusError` with the server's `error` text otherwise."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.is_error:
        message = body.get("error") if isinstance(body, dict) else None
        raise HTTPStatusError(response.status_code, str(message or response.text[:300]), method, path)
    return body


def transport_error(exc: httpx.HTTPError, url: str) -> TransportError:
    """The `TransportError` for an httpx failure (call it in an `except`, raise what it returns)."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return ConnectError(f"cannot reach the tether server at {url}: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return RequestTimeout(f"the tether server at {url} did not answer in time: {exc}")
    return TransportError(f"the request to the tether server at {url} failed: {exc}")


def _list_of(model: Any) -> Callable[[Any], Any]:
    adapter = TypeAdapter(list[model])
    return adapter.validate_python


def _dict(body: Any) -> dict[str, Any]:
    return dict(body)


# -- the calls -------------------------------------------------------------------------------------------------

def health() -> Call[dict[str, Any]]:
    return Call("GET", f"{API}/health", _dict)


def devices(status: str | None, tags: Sequence[str], name: str | None) -> Call[list[Device]]:
    params: dict[str, Any] = {k: v for k, v in {"status": status, "name": name}.items() if v is not None}
    if tags:
        params["tag"] = list(tags)
    return Call("GET", f"{API}/devices", _list_of(Device), params=params)


def device(name: str) -> Call[DeviceDetail]:
    return Call("GET", f"{API}/devices/{part(name)}", DeviceDetail.model_validate)


def tools(name: str) -> Call[list[ToolInfo]]:
    return Call("GET", f"{API}/devices/{part(name)}/tools", _list_of(ToolInfo))


def _batch_body(commands: Sequence[Command], batch_timeout: float, early_exit: bool, session_id: str | None,
                device: str | None, requires: DeviceRequirements | dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"commands": [c.model_dump(mode="json", exclude_none=True) for c in commands],
                            "timeout": batch_timeout, "early_exit": early_exit}
    if session_id is not None:
        body["session_id"] = session_id
    if device is not None:
        return f"{API}/devices/{part(device)}/commands", body
    body["requires"] = _requirements(requires)
    return f"{API}/commands", body


def _requirements(requires: DeviceRequirements | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(requires, DeviceRequirements):
        return requires.model_dump(mode="json", exclude_defaults=True)
    return dict(requires or {})


def run(commands: Sequence[Command], batch_timeout: float, early_exit: bool, session_id: str | None,
        device: str | None, requires: DeviceRequirements | dict[str, Any] | None) -> StreamCall[Event | BatchResults]:
    """A batch whose events stream as they come (SSE), ending with its `BatchResults`."""
    path, body = _batch_body(commands, batch_timeout, early_exit, session_id, device, requires)
    batch: list[str] = []  # the id the stream's first event names

    def item(event: str, data: Any) -> tuple[Event | BatchResults | None, bool]:
        if event == "device":
            batch.append(str(data.get("batch", "")))
            return None, False
        if event == "event":
            return Event.model_validate(data), False
        if event == "results":
            return BatchResults.model_validate({**data, "batch": batch[0] if batch else None}), True
        return None, False

    return StreamCall("POST", path, item, batch_timeout + STREAM_SLACK_S, json=body)


def batch(batch_id: str) -> Call[dict[str, Any]]:
    return Call("GET", f"{API}/batches/{part(batch_id)}", _dict)


def cancel_batch(batch_id: str) -> Call[dict[str, Any]]:
    return Call("DELETE", f"{API}/batches/{part(batch_id)}", _dict)


TRANSFER_READ_S = 3600.0  # a transfer answers when it ends: a large one over a slow link takes a while


def transfer(source: str, source_path: str, dest: str, dest_path: str, options: dict[str, Any]) -> Call[Result]:
    """A file or directory from one device to another (docs/transfer.md); the answer is its `Result`."""
    body = {"source": source, "source_path": source_path, "dest": dest, "dest_path": dest_path,
            **{k: v for k, v in options.items() if v is not None}}
    return Call("POST", f"{API}/transfers", Result.model_validate, json=body, timeout=TRANSFER_READ_S)


FanOutItem = tuple[str, Any]  # ("fanout", id) | ("device", FanOutOutcome) | ("summary", FanOutSummary)


def fan_out(commands: Sequence[Command], requires: DeviceRequirements | dict[str, Any] | None,
            max_concurrency: int | None, fan_timeout: float, early_exit: bool) -> StreamCall[FanOutItem]:
    """One batch to every device meeting `requires`: its id, then each device's line, then the summary."""
    body: dict[str, Any] = {"commands": [c.model_dump(mode="json", exclude_none=True) for c in commands],
                            "requires": _requirements(requires), "timeout": fan_timeout, "early_exit": early_exit}
    if max_concurrency is not None:
        body["max_concurrency"] = max_concurrency

    def item(event: str, data: Any) -> tuple[FanOutItem | None, bool]:
        if event == "fanout":
            return ("fanout", str(data["id"])), False
        if event == "device":
            return ("device", FanOutOutcome.model_validate(data)), False
        if event == "summary":
            return ("summary", FanOutSummary.model_validate(data["summary"])), True
        return None, False

    return StreamCall("POST", f"{API}/fleet/commands", item, fan_timeout + STREAM_SLACK_S, json=body)


def cancel_fan_out(fanout_id: str) -> Call[dict[str, Any]]:
    return Call("DELETE", f"{API}/fleet/commands/{part(fanout_id)}", _dict)


def create_task(request: str, plan: Sequence[dict[str, Any]] | None, device: str | None,
                requires: DeviceRequirements | dict[str, Any] | None, devices: Sequence[str],
                confirm: str | None) -> Call[TaskSummary]:
    body: dict[str, Any] = {"request": request, "devices": list(devices)}
    if plan is not None:
        body["plan"] = list(plan)
    if device is not None:
        body["device"] = device
    if requires is not None:
        body["requires"] = _requirements(requires)
    if confirm is not None:
        body["confirm"] = confirm
    return Call("POST", f"{API}/tasks", TaskSummary.model_validate, json=body)


def _task(body: Any) -> Task:
    """The task as stored; the drawn `graph` the API adds is left out (`tether.agent.run.graph.view.graph_of`
    makes it from the task)."""
    return Task.model_validate({k: v for k, v in body.items() if k != "graph"} if isinstance(body, dict) else body)


def task(task_id: str, events: bool) -> Call[Task]:
    return Call("GET", f"{API}/tasks/{part(task_id)}", _task, params={"events": str(events).lower()})


def tasks(limit: int, state: str | None) -> Call[list[TaskSummary]]:
    params: dict[str, Any] = {"limit": limit, **({"state": state} if state else {})}
    return Call("GET", f"{API}/tasks", _list_of(TaskSummary), params=params)


def answer(task_id: str, text: str, question_id: str | None, digest: str | None) -> Call[TaskSummary]:
    body: dict[str, Any] = {"answer": text, **({"question_id": question_id} if question_id else {}),
                            **({"digest": digest} if digest else {})}
    return Call("POST", f"{API}/tasks/{part(task_id)}/answer", TaskSummary.model_validate, json=body)


def approve(task_id: str, approved: bool, always: str | None, digest: str | None) -> Call[TaskSummary]:
    body: dict[str, Any] = {"approved": approved, **({"always": always} if always else {}),
                            **({"digest": digest} if digest else {})}
    return Call("POST", f"{API}/tasks/{part(task_id)}/approval", TaskSummary.model_validate, json=body)


def cancel_task(task_id: str) -> Call[TaskSummary]:
    return Call("POST", f"{API}/tasks/{part(task_id)}/cancel", TaskSummary.model_validate)


def edit_task(task_id: str, edit: dict[str, Any]) -> Call[dict[str, Any]]:
    return Call("POST", f"{API}/tasks/{part(task_id)}/edits", _dict, json=dict(edit))


def task_events(task_id: str, after: int, read_timeout: float) -> StreamCall[TaskEvent | TaskEnd]:
    """A task's events after `after`, ending with its `TaskEnd`."""

    def item(event: str, data: Any) -> tuple[TaskEvent | TaskEnd | None, bool]:
        if event == "task_event":
            return TaskEvent.model_validate(data), False
        if event == "end":
            return TaskEnd.model_validate(data), True
        return None, False

    return StreamCall("GET", f"{API}/tasks/{part(task_id)}/events", item, read_timeout, params={"after": after})


def answer_question(device: str, question: str, action: str,
                    content: dict[str, Any] | None) -> Call[dict[str, Any]]:
    return Call("POST", f"{API}/devices/{part(device)}/questions/{part(question)}", _dict,
                json={"action": action, "content": content})


def audit(limit: int, device: str | None, task: str | None, token: str | None, since: float | None,
          until: float | None, before: int | None) -> Call[AuditPage]:
    params = {k: v for k, v in {"limit": limit, "device": device, "task": task, "token": token, "since": since,
                                "until": until, "before": before}.items() if v is not None}
    return Call("GET", f"{API}/audit", AuditPage.model_validate, params=params)
