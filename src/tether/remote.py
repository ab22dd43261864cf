"""A small client for the agent server's REST API, used by the CLI (and usable from scripts)."""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from tether.protocol.messages import Event
from tether.protocol.models import Command, Result, ToolInfo

DEFAULT_SERVER = "http://127.0.0.1:8765"


class RemoteError(RuntimeError):
    """The server said no (its `error` text), or could not be reached; the message says which."""


class RemoteServer:
    def __init__(self, base_url: str | None = None, token: str | None = None, *, ca_file: str | None = None,
                 timeout: float = 30.0) -> None:
        self.base_url = (base_url or os.environ.get("TETHER_SERVER") or DEFAULT_SERVER).rstrip("/")
        if self.base_url.startswith(("ws://", "wss://")):
            self.base_url = "http" + self.base_url[2:].removesuffix("/aip")
        self.token = token or os.environ.get("TETHER_TOKEN")
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        ca = ca_file or os.environ.get("TETHER_CA_FILE")
        verify: Any = ssl.create_default_context(cafile=ca) if ca else True
        self._http = httpx.Client(base_url=self.base_url + "/api/v1", headers=headers, verify=verify,
                                  timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RemoteError(f"cannot reach the tether server at {self.base_url}: {exc}") from None
        return self._decode(response)

    @staticmethod
    def _decode(response: httpx.Response) -> Any:
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.is_error:
            message = body.get("error") if isinstance(body, dict) else None
            raise RemoteError(f"server answered {response.status_code}: {message or response.text[:300]}")
        return body

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health")

    def devices(self) -> list[dict[str, Any]]:
        return self._request("GET", "/devices")

    def device(self, name: str) -> dict[str, Any]:
        return self._request("GET", f"/devices/{name}")

    def tools(self, name: str) -> list[ToolInfo]:
        return [ToolInfo.model_validate(t) for t in self._request("GET", f"/devices/{name}/tools")]

    def run(self, device: str | None, commands: list[Command], *, timeout: float = 60.0, early_exit: bool = True,
            session_id: str | None = None, requires: dict[str, Any] | None = None,
            on_event: Callable[[Event], None] | None = None) -> tuple[str, list[Result]]:
        """Run a batch (on `device`, or on one chosen by `requires`), streaming events as they come."""
        body: dict[str, Any] = {"commands": [c.model_dump(exclude_none=True) for c in commands],
                                "timeout": timeout, "early_exit": early_exit, "session_id": session_id}
        path = f"/devices/{device}/commands" if device else "/commands"
        if device is None:
            body["requires"] = requires or {}
        try:
            with self._http.stream("POST", path, json=body, headers={"Accept": "text/event-stream"},
                                   timeout=httpx.Timeout(timeout + 30, connect=10)) as response:
                if response.is_error:
                    response.read()
                    self._decode(response)
                for event, data in _sse_events(response.iter_lines()):
                    if event == "event" and on_event is not None:
                        on_event(Event.model_validate(data))
                    elif event == "results":
                        return data["device"], [Result.model_validate(r) for r in data["results"]]
        except httpx.HTTPError as exc:
            raise RemoteError(f"lost the connection to {self.base_url} while the batch ran: {exc}") from None
        raise RemoteError("the server closed the stream before sending results")


def _sse_events(lines: Iterator[str]) -> Iterator[tuple[str, Any]]:
    event, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
