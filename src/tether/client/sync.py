"""`tether.Client`: the typed, synchronous REST client of a tether server."""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx

from tether.agent.run.task import Task, TaskEvent
from tether.client import calls
from tether.client.errors import IncompleteStream
from tether.client.hints import Hints
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
from tether.client.saved import find_token
from tether.client.sse import iter_sse
from tether.protocol.messages import Event
from tether.protocol.models import Command, Result, ToolInfo
from tether.protocol.profile import DeviceRequirements

__all__ = ["Client"]

T = TypeVar("T")


class Client:
    """A tether server's REST API from synchronous Python: devices, commands (streamed), fan-out, tasks,
    approvals, audit.

    `base_url` is the server (`http://127.0.0.1:8765`; a device's `ws://…/aip` works too); `token` an API
    token, sent in the `Authorization` header (left out: $TETHER_TOKEN, else the token `tether token create
    --admin` saved, `~/.config/tether/token` or $TETHER_TOKEN_FILE, as the CLI finds it). `timeout`
    (seconds) bounds every call that has no timeout of its own. TLS: `verify` is True (the system's CAs), a
    CA file path, an `ssl.SSLContext`, or False; `pin` a SHA-256 certificate fingerprint to trust instead
    (the one certificate, host name unchecked).
    Use it as a context manager, or call `close()`.

    Every method raises `HTTPStatusError` (the server refused: `.status`, `.message`), `ConnectError`
    (not reached), `RequestTimeout` or `TransportError` (the request did not complete), all
    `tether.errors.ClientError`. `ValueError` for a bad `base_url` or `pin`.
    """

    def __init__(self, base_url: str, token: str | None = None, *, timeout: float = 30.0,
                 verify: bool | str | ssl.SSLContext = True, pin: str | None = None) -> None:
        from tether.device.link.trust.tls_pin import normalize_fingerprint

        self.base_url = calls.base_url(base_url)
        self.timeout = timeout
        self._pin = normalize_fingerprint(pin) if pin else None
        self._token = find_token(token)
        self._verify = calls.verify_context(verify)
        self._hints = Hints(self.base_url)  # a cluster's X-Tether-Holder: the node holding a device
        self._http: httpx.Client | None = None

    def _client(self) -> httpx.Client:
        if self._http is None:
            verify = self._verify
            if self._pin is not None:
                from tether.device.link.trust.tls_pin import pinned_context_for

                try:
                    verify = pinned_context_for(self.base_url, self._pin, min(self.timeout, calls.CONNECT_S))
                except (OSError, ValueError) as exc:
                    raise calls.ConnectError(f"cannot reach the tether server at {self.base_url}: {exc}") from None
            self._http = httpx.Client(base_url=self.base_url, headers=calls.headers(self._token), verify=verify,
                                      timeout=calls.timeout(self.timeout))
        return self._http

    def close(self) -> None:
        """Close the connections; the client is not used after this."""
        if self._http is not None:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- transport ----------------------------------------------------------------------------------------------

    def _do(self, call: calls.Call[T]) -> T:
        extra: dict[str, Any] = {"timeout": calls.timeout(call.timeout)} if call.timeout is not None else {}
        try:
            try:
                response = self._client().request(call.method, self._hints.url(call.path), params=call.params,
                                                  json=call.json, **extra)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                if not self._hints.hinted(call.path):
                    raise
                self._hints.forget(call.path)  # the hinted node is not reachable from here: nothing was sent
                response = self._client().request(call.method, call.path, params=call.params, json=call.json,
                                                  **extra)
        except httpx.HTTPError as exc:
            raise calls.transport_error(exc, self.base_url) from None
        self._hints.learn(call.path, response)
        return call.parse(calls.decoded(response, call.method, call.path))

    def _stream(self, call: calls.StreamCall[T]) -> Iterator[T]:
        if self._hints.hinted(call.path):
            try:
                yield from self._stream_to(call, self._hints.url(call.path))
                return
            except calls.ConnectError:  # the hinted node is not reachable from here: nothing was sent
                self._hints.forget(call.path)
        yield from self._stream_to(call, call.path)

    def _stream_to(self, call: calls.StreamCall[T], url: str) -> Iterator[T]:
        try:
            with self._client().stream(call.method, url, params=call.params, json=call.json,
                                       headers=call.headers, timeout=calls.timeout(call.timeout)) as response:
                self._hints.learn(call.path, response)
                if response.is_error:
                    response.read()
                    calls.decoded(response, call.method, call.path)
                for event, data in iter_sse(response.iter_lines()):
                    item, last = call.item(event, data)
                    if item is not None:
                        yield item
                    if last:
                        return
        except httpx.HTTPError as exc:
            raise calls.transport_error(exc, self.base_url) from None
        raise IncompleteStream(f"{self.base_url} closed the stream of {call.method} {call.path} before its end")

    # -- server and devices -------------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """The server's `/health`: `status` ok or degraded, `devices_online`, `audit_writable`."""
        return self._do(calls.health())

    def devices(self, *, status: str | None = None, tags: Sequence[str] = (), name: str | None = None) -> list[Device]:
        """The devices the token reaches, by name; filtered by `status` (online, busy, offline), every tag of
        `tags`, and `name` (a glob such as `lab-*`)."""
        return self._do(calls.devices(status, tags, name))

    def device(self, name: str) -> DeviceDetail:
        """One device with its registered profile; `HTTPStatusError` 404 when there is none by that name."""
        return self._do(calls.device(name))

    def tools(self, name: str) -> list[ToolInfo]:
        """The device's tools (asked live when it is online, else from its profile)."""
        return self._do(calls.tools(name))

    # -- commands -----------------------------------------------------------------------------------------------

    def stream(self, device: str | None, commands: Sequence[Command], *, timeout: float = 60.0,
               early_exit: bool = True, session_id: str | None = None,
               requires: DeviceRequirements | dict[str, Any] | None = None) -> Iterator[Event | BatchResults]:
        """Run a batch on `device` (or, when None, on the least-loaded device meeting `requires`) and yield
        each progress `Event` (streamed output, questions) as it comes, then the `BatchResults` last.
        `timeout` is the batch's, on the server; the read timeout is that plus 30 s. `IncompleteStream`
        when the server ends the stream without results."""
        return self._stream(calls.run(commands, timeout, early_exit, session_id, device, requires))

    def run(self, device: str | None, commands: Sequence[Command], *, timeout: float = 60.0,
            early_exit: bool = True, session_id: str | None = None,
            requires: DeviceRequirements | dict[str, Any] | None = None,
            on_event: Callable[[Event], None] | None = None) -> BatchResults:
        """`stream()` to its end: the batch's results, each event passed to `on_event` on the way."""
        for item in self.stream(device, commands, timeout=timeout, early_exit=early_exit, session_id=session_id,
                                requires=requires):
            if isinstance(item, BatchResults):
                return item
            if on_event is not None:
                on_event(item)
        raise IncompleteStream("the command stream ended without results")  # `_stream` raises first

    def transfer(self, source: str, source_path: str, dest: str, dest_path: str, *, overwrite: bool = False,
                 max_bytes: int | None = None, chunk_bytes: int | None = None, session_id: str | None = None,
                 approve: bool = False, approval_digest: str | None = None) -> Result:
        """Send `source_path` on device `source` to `dest_path` on device `dest`, in checked chunks through
        the server (docs/transfer.md); returns the transfer's `Result` (a failure names the step and the
        reason; a destination reserved for a person comes back needing approval, then send it again with
        `approve=True` and the `approval_digest` it showed, with a person's token). Options: `overwrite`,
        `max_bytes`, `chunk_bytes`, `session_id` (the receiver's undo session)."""
        return self._do(calls.transfer(source, source_path, dest, dest_path, {
            "overwrite": overwrite, "max_bytes": max_bytes, "chunk_bytes": chunk_bytes, "session_id": session_id,
            "approve": approve, "approval_digest": approval_digest}))

    def batch(self, batch_id: str) -> dict[str, Any]:
        """A batch's record: its `state` (running, pending, done) and each command's outcome."""
        return self._do(calls.batch(batch_id))

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        """Cancel a running batch on its device; 404 when none by that id runs."""
        return self._do(calls.cancel_batch(batch_id))

    def fan_out(self, commands: Sequence[Command], *, requires: DeviceRequirements | dict[str, Any] | None = None,
                max_concurrency: int | None = None, timeout: float = 60.0, early_exit: bool = True,
                on_device: Callable[[FanOutOutcome], None] | None = None) -> FanOutReport:
        """Run one batch on every device meeting `requires` (at most `max_concurrency` at once; `timeout` for
        the whole fan-out), each device's outcome passed to `on_device` as it ends; the whole report.
        `HTTPStatusError` 404 when no device meets `requires`."""
        fan_id, outcomes, summary = "", [], None
        for kind, value in self._stream(calls.fan_out(commands, requires, max_concurrency, timeout, early_exit)):
            if kind == "fanout":
                fan_id = value
            elif kind == "device":
                outcomes.append(value)
                if on_device is not None:
                    on_device(value)
            else:
                summary = value
        assert isinstance(summary, FanOutSummary)  # `_stream` raises IncompleteStream without one
        return FanOutReport(id=fan_id, devices=outcomes, summary=summary)

    def cancel_fan_out(self, fanout_id: str) -> dict[str, Any]:
        """Cancel a running fan-out (its id is `FanOutReport.id`, or the first event of its stream)."""
        return self._do(calls.cancel_fan_out(fanout_id))

    # -- tasks and approvals ------------------------------------------------------------------------------------

    def create_task(self, request: str = "", *, plan: Sequence[dict[str, Any]] | None = None,
                    device: str | None = None, requires: DeviceRequirements | dict[str, Any] | None = None,
                    devices: Sequence[str] = (), confirm: str | None = None) -> TaskSummary:
        """Create a task and start it: `request` in words (planned by the server's LLM) or `plan` as given
        (steps `{"tool", "args", ...}`), on `device` or one meeting `requires`. `confirm` (never,
        destructive, always) makes the plan wait for a person's approval first."""
        return self._do(calls.create_task(request, plan, device, requires, devices, confirm))

    def task(self, task_id: str, *, events: bool = True) -> Task:
        """The whole task (plan, steps, questions, and its events unless `events` is False); an id prefix works."""
        return self._do(calls.task(task_id, events))

    def tasks(self, *, limit: int = 50, state: str | None = None) -> list[TaskSummary]:
        """Tasks newest first, at most `limit`, only those in `state` when given."""
        return self._do(calls.tasks(limit, state))

    def task_events(self, task_id: str, *, after: int = -1,
                    read_timeout: float = 60.0) -> Iterator[TaskEvent | TaskEnd]:
        """The task's events after sequence number `after` as they happen, then its `TaskEnd`. The server
        sends a keep-alive every 15 s, so `read_timeout` bounds a silent connection, not the task."""
        return self._stream(calls.task_events(task_id, after, read_timeout))

    def wait_task(self, task_id: str, *, read_timeout: float = 60.0) -> TaskEnd:
        """Follow the task until it ends (or the server stops under it: `ended` False); its end."""
        for item in self.task_events(task_id, read_timeout=read_timeout):
            if isinstance(item, TaskEnd):
                return item
        raise IncompleteStream("the task's stream ended without its end")  # `_stream` raises first

    def answer(self, task_id: str, answer: str, *, question_id: str | None = None,
               digest: str | None = None) -> TaskSummary:
        """Answer the task's open question (an option's text or number, or free words); `digest` (the
        question's, as shown) binds the answer to it (409 when the task now asks something else). An
        approval question needs a person's token holding `approve`."""
        return self._do(calls.answer(task_id, answer, question_id, digest))

    def approve(self, task_id: str, approved: bool = True, *, always: str | None = None,
                digest: str | None = None) -> TaskSummary:
        """Approve (or, `approved=False`, deny and so cancel) what the task waits on. Approving needs a
        person's token holding `approve` (403 for an agent's); `digest` binds it to what was shown."""
        return self._do(calls.approve(task_id, approved, always, digest))

    def cancel_task(self, task_id: str) -> TaskSummary:
        """Cancel the task."""
        return self._do(calls.cancel_task(task_id))

    def edit_task(self, task_id: str, edit: dict[str, Any]) -> dict[str, Any]:
        """Edit the task's running graph: `edit` is {add: [steps], remove: [ids], add_needs: {id: [ids]}}
        (docs/graphs.md). Returns {task, status: applied | waiting_for_confirmation, step_states}; an edit the
        graph refuses raises the API error (409/422) whose message gives every reason."""
        return self._do(calls.edit_task(task_id, edit))

    def answer_question(self, device: str, question: str, action: str,
                        content: dict[str, Any] | None = None) -> dict[str, Any]:
        """Answer (`action` accept, decline or cancel) the question an external MCP server of `device` asked
        while a command ran (the `id` of the command's `elicitation` event). Needs a person's token."""
        return self._do(calls.answer_question(device, question, action, content))

    # -- audit ----------------------------------------------------------------------------------------------------

    def audit(self, *, limit: int = 100, device: str | None = None, task: str | None = None,
              token: str | None = None, since: float | None = None, until: float | None = None,
              before: int | None = None) -> AuditPage:
        """Audit rows newest first (at most `limit`, up to 500), filtered by device, task (id or prefix),
        API token name and time (unix seconds); pass `page.next` as `before` for the next page. Needs `admin`."""
        return self._do(calls.audit(limit, device, task, token, since, until, before))
