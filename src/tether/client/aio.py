"""`tether.AsyncClient`: the typed asyncio REST client of a tether server (the same calls as `Client`)."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable, Sequence
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
from tether.client.sse import aiter_sse
from tether.protocol.messages import Event
from tether.protocol.models import Command, Result, ToolInfo
from tether.protocol.profile import DeviceRequirements

__all__ = ["AsyncClient"]

T = TypeVar("T")


class AsyncClient:
    """A tether server's REST API from asyncio: the methods of `tether.Client`, awaited (and its streams
    iterated with `async for`). Arguments, answers and errors are `Client`'s; use it as `async with`, or
    `await aclose()`."""

    def __init__(self, base_url: str, token: str | None = None, *, timeout: float = 30.0,
                 verify: bool | str | ssl.SSLContext = True, pin: str | None = None) -> None:
        from tether.device.link.trust.tls_pin import normalize_fingerprint

        self.base_url = calls.base_url(base_url)
        self.timeout = timeout
        self._pin = normalize_fingerprint(pin) if pin else None
        self._token = find_token(token)
        self._verify = calls.verify_context(verify)
        self._hints = Hints(self.base_url)  # a cluster's X-Tether-Holder: the node holding a device
        self._http: httpx.AsyncClient | None = None

    async def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            verify = self._verify
            if self._pin is not None:
                from tether.device.link.trust.tls_pin import pinned_context_for_async

                try:
                    verify = await pinned_context_for_async(self.base_url, self._pin,
                                                            min(self.timeout, calls.CONNECT_S))
                except (OSError, ValueError) as exc:
                    raise calls.ConnectError(f"cannot reach the tether server at {self.base_url}: {exc}") from None
            self._http = httpx.AsyncClient(base_url=self.base_url, headers=calls.headers(self._token), verify=verify,
                                           timeout=calls.timeout(self.timeout))
        return self._http

    async def aclose(self) -> None:
        """Close the connections; the client is not used after this."""
        if self._http is not None:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    # -- transport ----------------------------------------------------------------------------------------------

    async def _do(self, call: calls.Call[T]) -> T:
        extra: dict[str, Any] = {"timeout": calls.timeout(call.timeout)} if call.timeout is not None else {}
        client = await self._client()
        try:
            try:
                response = await client.request(call.method, self._hints.url(call.path), params=call.params,
                                                json=call.json, **extra)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                if not self._hints.hinted(call.path):
                    raise
                self._hints.forget(call.path)  # the hinted node is not reachable from here: nothing was sent
                response = await client.request(call.method, call.path, params=call.params, json=call.json, **extra)
        except httpx.HTTPError as exc:
            raise calls.transport_error(exc, self.base_url) from None
        self._hints.learn(call.path, response)
        return call.parse(calls.decoded(response, call.method, call.path))

    async def _stream(self, call: calls.StreamCall[T]) -> AsyncIterator[T]:
        if self._hints.hinted(call.path):
            try:
                async for item in self._stream_to(call, self._hints.url(call.path)):
                    yield item
                return
            except calls.ConnectError:  # the hinted node is not reachable from here: nothing was sent
                self._hints.forget(call.path)
        async for item in self._stream_to(call, call.path):
            yield item

    async def _stream_to(self, call: calls.StreamCall[T], url: str) -> AsyncIterator[T]:
        try:
            async with (await self._client()).stream(call.method, url, params=call.params, json=call.json,
                                                     headers=call.headers,
                                                     timeout=calls.timeout(call.timeout)) as response:
                self._hints.learn(call.path, response)
                if response.is_error:
                    await response.aread()
                    calls.decoded(response, call.method, call.path)
                async for event, data in aiter_sse(response.aiter_lines()):
                    item, last = call.item(event, data)
                    if item is not None:
                        yield item
                    if last:
                        return
        except httpx.HTTPError as exc:
            raise calls.transport_error(exc, self.base_url) from None
        raise IncompleteStream(f"{self.base_url} closed the stream of {call.method} {call.path} before its end")

    # -- server and devices -------------------------------------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        """See `Client.health`."""
        return await self._do(calls.health())

    async def devices(self, *, status: str | None = None, tags: Sequence[str] = (),
                      name: str | None = None) -> list[Device]:
        """See `Client.devices`."""
        return await self._do(calls.devices(status, tags, name))

    async def device(self, name: str) -> DeviceDetail:
        """See `Client.device`."""
        return await self._do(calls.device(name))

    async def tools(self, name: str) -> list[ToolInfo]:
        """See `Client.tools`."""
        return await self._do(calls.tools(name))

    # -- commands -----------------------------------------------------------------------------------------------

    def stream(self, device: str | None, commands: Sequence[Command], *, timeout: float = 60.0,
               early_exit: bool = True, session_id: str | None = None,
               requires: DeviceRequirements | dict[str, Any] | None = None) -> AsyncIterator[Event | BatchResults]:
        """See `Client.stream`; iterate it with `async for`."""
        return self._stream(calls.run(commands, timeout, early_exit, session_id, device, requires))

    async def run(self, device: str | None, commands: Sequence[Command], *, timeout: float = 60.0,
                  early_exit: bool = True, session_id: str | None = None,
                  requires: DeviceRequirements | dict[str, Any] | None = None,
                  on_event: Callable[[Event], None] | None = None) -> BatchResults:
        """See `Client.run`."""
        async for item in self.stream(device, commands, timeout=timeout, early_exit=early_exit,
                                      session_id=session_id, requires=requires):
            if isinstance(item, BatchResults):
                return item
            if on_event is not None:
                on_event(item)
        raise IncompleteStream("the command stream ended without results")  # `_stream` raises first

    async def transfer(self, source: str, source_path: str, dest: str, dest_path: str, *, overwrite: bool = False,
                       max_bytes: int | None = None, chunk_bytes: int | None = None, session_id: str | None = None,
                       approve: bool = False, approval_digest: str | None = None) -> Result:
        """Send `source_path` on device `source` to `dest_path` on device `dest`, in checked chunks through
        the server (docs/transfer.md); returns the transfer's `Result` (a failure names the step and the
        reason; a destination reserved for a person comes back needing approval, then send it again with
        `approve=True` and the `approval_digest` it showed, with a person's token). Options: `overwrite`,
        `max_bytes`, `chunk_bytes`, `session_id` (the receiver's undo session)."""
        return await self._do(calls.transfer(source, source_path, dest, dest_path, {
            "overwrite": overwrite, "max_bytes": max_bytes, "chunk_bytes": chunk_bytes, "session_id": session_id,
            "approve": approve, "approval_digest": approval_digest}))

    async def batch(self, batch_id: str) -> dict[str, Any]:
        """See `Client.batch`."""
        return await self._do(calls.batch(batch_id))

    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        """See `Client.cancel_batch`."""
        return await self._do(calls.cancel_batch(batch_id))

    async def fan_out(self, commands: Sequence[Command], *,
                      requires: DeviceRequirements | dict[str, Any] | None = None, max_concurrency: int | None = None,
                      timeout: float = 60.0, early_exit: bool = True,
                      on_device: Callable[[FanOutOutcome], None] | None = None) -> FanOutReport:
        """See `Client.fan_out`."""
        fan_id, outcomes, summary = "", [], None
        async for kind, value in self._stream(calls.fan_out(commands, requires, max_concurrency, timeout,
                                                            early_exit)):
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

    async def cancel_fan_out(self, fanout_id: str) -> dict[str, Any]:
        """See `Client.cancel_fan_out`."""
        return await self._do(calls.cancel_fan_out(fanout_id))

    # -- tasks and approvals ------------------------------------------------------------------------------------

    async def create_task(self, request: str = "", *, plan: Sequence[dict[str, Any]] | None = None,
                          device: str | None = None, requires: DeviceRequirements | dict[str, Any] | None = None,
                          devices: Sequence[str] = (), confirm: str | None = None) -> TaskSummary:
        """See `Client.create_task`."""
        return await self._do(calls.create_task(request, plan, device, requires, devices, confirm))

    async def task(self, task_id: str, *, events: bool = True) -> Task:
        """See `Client.task`."""
        return await self._do(calls.task(task_id, events))

    async def tasks(self, *, limit: int = 50, state: str | None = None) -> list[TaskSummary]:
        """See `Client.tasks`."""
        return await self._do(calls.tasks(limit, state))

    def task_events(self, task_id: str, *, after: int = -1,
                    read_timeout: float = 60.0) -> AsyncIterator[TaskEvent | TaskEnd]:
        """See `Client.task_events`; iterate it with `async for`."""
        return self._stream(calls.task_events(task_id, after, read_timeout))

    async def wait_task(self, task_id: str, *, read_timeout: float = 60.0) -> TaskEnd:
        """See `Client.wait_task`."""
        async for item in self.task_events(task_id, read_timeout=read_timeout):
            if isinstance(item, TaskEnd):
                return item
        raise IncompleteStream("the task's stream ended without its end")  # `_stream` raises first

    async def answer(self, task_id: str, answer: str, *, question_id: str | None = None,
                     digest: str | None = None) -> TaskSummary:
        """See `Client.answer`."""
        return await self._do(calls.answer(task_id, answer, question_id, digest))

    async def approve(self, task_id: str, approved: bool = True, *, always: str | None = None,
                      digest: str | None = None) -> TaskSummary:
        """See `Client.approve`."""
        return await self._do(calls.approve(task_id, approved, always, digest))

    async def cancel_task(self, task_id: str) -> TaskSummary:
        """See `Client.cancel_task`."""
        return await self._do(calls.cancel_task(task_id))

    async def edit_task(self, task_id: str, edit: dict[str, Any]) -> dict[str, Any]:
        """See `Client.edit_task`."""
        return await self._do(calls.edit_task(task_id, edit))

    async def answer_question(self, device: str, question: str, action: str,
                              content: dict[str, Any] | None = None) -> dict[str, Any]:
        """See `Client.answer_question`."""
        return await self._do(calls.answer_question(device, question, action, content))

    # -- audit ----------------------------------------------------------------------------------------------------

    async def audit(self, *, limit: int = 100, device: str | None = None, task: str | None = None,
                    token: str | None = None, since: float | None = None, until: float | None = None,
                    before: int | None = None) -> AuditPage:
        """See `Client.audit`."""
        return await self._do(calls.audit(limit, device, task, token, since, until, before))
