"""The low-level synchronous REST transport the CLI uses: plain dicts, `RemoteError` with the server's words.

Python programs use `tether.Client` / `tether.AsyncClient` (typed models, one error per failure kind).
"""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from tether.client.hints import Hints
from tether.client.saved import find_token
from tether.client.saved import saved_token as saved_token  # re-exported: the CLI imports them from here
from tether.client.saved import token_file_path as token_file_path
from tether.client.sse import iter_sse
from tether.errors import ClientError
from tether.protocol.messages import Event
from tether.protocol.models import Command, Result, ToolInfo

DEFAULT_SERVER = "http://127.0.0.1:8765"


class RemoteError(ClientError, RuntimeError):
    """The server said no (its `error` text), or could not be reached; the message says which.
    `status` is the HTTP status of a refusal (None when the server was not reached)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RemoteServer:
    def __init__(self, base_url: str | None = None, token: str | None = None, *, ca_file: str | None = None,
                 timeout: float = 30.0) -> None:
        self.base_url = (base_url or os.environ.get("TETHER_SERVER") or DEFAULT_SERVER).rstrip("/")
        if self.base_url.startswith(("ws://", "wss://")):
            self.base_url = "http" + self.base_url[2:].removesuffix("/aip")
        self.token = find_token(token)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        ca = ca_file or os.environ.get("TETHER_CA_FILE")
        verify: Any = ssl.create_default_context(cafile=ca) if ca else True
        try:
            self._http = httpx.Client(base_url=self.base_url + "/api/v1", headers=headers, verify=verify,
                                      timeout=timeout)
        except httpx.InvalidURL as exc:  # a mistyped --server or TETHER_SERVER (a bad port, a control character)
            raise RemoteError(f"cannot reach the tether server at {self.base_url!r}: not a URL ({exc})") from None
        self._hints = Hints(self.base_url)  # a cluster's X-Tether-Holder: the node holding a device

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
        if not response.is_success:  # a redirect too: never followed, and its empty body is no answer
            message = body.get("error") if isinstance(body, dict) else None
            text = message or response.text[:300] or response.reason_phrase
            if response.is_redirect:  # an empty or slash-ended name (`tether log ""`): where it led, never followed
                text += f" to {response.headers.get('location', '?')} (not followed: give a name the server knows)"
            raise RemoteError(f"server answered {response.status_code}: {text}", response.status_code)
        return body

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health")

    def devices(self) -> list[dict[str, Any]]:
        return self._request("GET", "/devices")

    def device(self, name: str) -> dict[str, Any]:
        return self._request("GET", f"/devices/{_quote(name)}")

    def device_key(self, name: str) -> dict[str, Any]:
        """The key enrolled for the device: `{name, fingerprint, enrolled_at, enrolled_by}`."""
        return self._request("GET", f"/devices/{_quote(name)}/key")

    def remove_device(self, name: str) -> dict[str, Any]:
        """Forget the device (admin): `{removed, was, revoked_tokens}` (docs/fleet.md)."""
        return self._request("DELETE", f"/devices/{_quote(name)}")

    def change_device(self, name: str, *, new_name: str | None = None, tags: list[str] | None = None
                      ) -> dict[str, Any]:
        """Rename the device and/or set its tags (admin): `{name, tags}` as it now is (docs/fleet.md)."""
        body: dict[str, Any] = {}
        if new_name is not None:
            body["name"] = new_name
        if tags is not None:
            body["tags"] = tags
        return self._request("PATCH", f"/devices/{_quote(name)}", json=body)

    def pairing_requests(self) -> list[dict[str, Any]]:
        return self._request("GET", "/pairing")

    def approve_pairing(self, code: str, name: str | None = None, tags: list[str] | None = None,
                        replace: bool = False) -> dict[str, Any]:
        return self._request("POST", f"/pairing/{_quote(code)}/approve",
                             json={"name": name, "tags": tags or [], "replace": replace})

    def refuse_pairing(self, code: str) -> dict[str, Any]:
        return self._request("POST", f"/pairing/{_quote(code)}/refuse")

    def tools(self, name: str, *, timeout: float | None = None, hints: bool = False) -> list[ToolInfo]:
        """The device's tools; `timeout` bounds this request (the client's default otherwise). `hints`: with
        their external MCP servers' `title` and `annotations` (ToolInfo.title/annotations), where given."""
        extra: dict[str, Any] = {"timeout": httpx.Timeout(timeout, connect=min(timeout, 10))} if timeout else {}
        if hints:
            extra["params"] = {"hints": "true"}
        return [ToolInfo.model_validate(t) for t in self._request("GET", f"/devices/{_quote(name)}/tools", **extra)]

    def policy(self, device: str) -> dict[str, Any]:
        return self._request("GET", f"/devices/{_quote(device)}/policy")

    def set_policy(self, device: str, policy: dict[str, Any], *, replace: bool = False) -> dict[str, Any]:
        return self._request("PUT", f"/devices/{_quote(device)}/policy", json={"policy": policy, "replace": replace})

    def policy_program(self, device: str, verb: str, program: str) -> dict[str, Any]:
        """`verb`: allow, deny or approve."""
        return self._request("POST", f"/devices/{_quote(device)}/policy/{verb}", json={"program": program})

    def run(self, device: str | None, commands: list[Command], *, timeout: float = 60.0, early_exit: bool = True,
            session_id: str | None = None, requires: dict[str, Any] | None = None,
            on_event: Callable[[Event], None] | None = None,
            on_batch: Callable[[str], None] | None = None) -> tuple[str, list[Result]]:
        """Run a batch (on `device`, or on one chosen by `requires`), streaming events as they come.

        `on_batch(batch_id)` is called once the server has named the batch (its `X-Tether-Batch` header),
        before any result. A connection lost or a stream closed before the results: RemoteError (status
        None), whose message names the batch and `tether batch ID` (its outcome) when the server had named it."""
        body: dict[str, Any] = {"commands": [c.model_dump(exclude_none=True) for c in commands],
                                "timeout": timeout, "early_exit": early_exit, "session_id": session_id}
        path = f"/devices/{_quote(device)}/commands" if device else "/commands"
        if device is None:
            body["requires"] = requires or {}
        full = "/api/v1" + path  # the hints' key: the path under the base URL
        named: list[str] = []  # the batch's id, once the server has sent it

        def learn(batch_id: str) -> None:
            named.append(batch_id)
            if on_batch is not None:
                on_batch(batch_id)

        try:
            url = path
            if self._hints.hinted(full):
                try:
                    url = ""
                    done = self._run(self._hints.url(full), full, body, timeout, on_event, learn)
                except (httpx.ConnectError, httpx.ConnectTimeout):  # the hinted node is unreachable: nothing sent
                    self._hints.forget(full)
                    url = path
            if url:
                done = self._run(url, full, body, timeout, on_event, learn)
        except httpx.HTTPError as exc:
            raise RemoteError(f"lost the connection to {self.base_url} while the batch ran: {exc}"
                              f"{_look_up(named)}") from None
        if done is None:
            raise RemoteError(f"the server closed the stream before sending results{_look_up(named)}")
        return done

    def _run(self, url: str, full: str, body: dict[str, Any], timeout: float,
             on_event: Callable[[Event], None] | None,
             on_batch: Callable[[str], None]) -> tuple[str, list[Result]] | None:
        """`run` sent to `url` (a path under the base URL, or a hinted node's URL): the device and results,
        None for a stream that ends before the results; raises httpx's errors."""
        with self._http.stream("POST", url, json=body, headers={"Accept": "text/event-stream"},
                               timeout=httpx.Timeout(timeout + 30, connect=10)) as response:
            self._hints.learn(full, response)
            if response.is_error:
                response.read()
                self._decode(response)
            if batch_id := response.headers.get("X-Tether-Batch"):
                on_batch(batch_id)
            for event, data in iter_sse(response.iter_lines()):
                if event == "event" and on_event is not None:
                    on_event(Event.model_validate(data))
                elif event == "results":
                    return data["device"], [Result.model_validate(r) for r in data["results"]]
        return None

    def transfer(self, body: dict[str, Any]) -> Result:
        """POST /api/v1/transfers (docs/transfer.md): the transfer's `Result` once it ends."""
        data = self._request("POST", "/transfers", json=body, timeout=httpx.Timeout(3600, connect=10))
        return Result.model_validate(data)

    def batch(self, batch_id: str) -> dict[str, Any]:
        """A batch's record (GET /api/v1/batches/{id}): its `state` (running, pending, done) and each
        command's outcome, also one that came after the caller's wait ended (docs/outcomes.md)."""
        return self._request("GET", f"/batches/{_quote(batch_id)}")

    # -- tasks --------------------------------------------------------------------------------------

    def create_task(self, request: str = "", *, plan: list[dict[str, Any]] | None = None, device: str | None = None,
                    requires: dict[str, Any] | None = None, devices: list[str] | None = None,
                    confirm: str | None = None) -> dict[str, Any]:
        """Create a task (planned by the server's LLM, or `plan` as given) and start it; its summary."""
        body = {"request": request, "plan": plan, "device": device, "requires": requires, "devices": devices or []}
        if confirm is not None:  # which plans wait for a person's confirmation (the token may be stricter)
            body["confirm"] = confirm
        return self._request("POST", "/tasks", json=body)

    def dry_run_task(self, request: str = "", *, plan: list[dict[str, Any]] | None = None,
                     device: str | None = None, requires: dict[str, Any] | None = None,
                     devices: list[str] | None = None) -> dict[str, Any]:
        """The plan the server would run (planned, or `plan` checked), its device and problems; nothing runs."""
        body = {"request": request, "plan": plan, "device": device, "requires": requires, "devices": devices or []}
        return self._request("POST", "/tasks/dry-run", json=body)

    def tasks(self, limit: int = 50, state: str | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit}
        if state:
            params["state"] = state
        return self._request("GET", "/tasks", params=params)

    def task(self, task_id: str, *, events: bool = True) -> dict[str, Any]:
        """The whole task (plan, steps, questions, events); an id prefix works."""
        return self._request("GET", f"/tasks/{_quote(task_id)}", params={"events": str(events).lower()})

    def answer(self, task_id: str, answer: str, question_id: str | None = None,
               digest: str | None = None) -> dict[str, Any]:
        """Answer the task's open question; `digest` (the question's, as shown) binds the answer to it."""
        body: dict[str, Any] = {"answer": answer, "question_id": question_id, **({"digest": digest} if digest else {})}
        return self._request("POST", f"/tasks/{_quote(task_id)}/answer", json=body)

    def answer_question(self, device: str, question: str, action: str,
                        content: dict[str, Any] | None = None) -> dict[str, Any]:
        """Answer the question an external MCP server of `device` asked during a command."""
        return self._request("POST", f"/devices/{_quote(device)}/questions/{_quote(question)}",
                             json={"action": action, "content": content})

    def approve(self, task_id: str, approved: bool = True, always: str | None = None,
                digest: str | None = None) -> dict[str, Any]:
        """Approve (or deny) what the task waits on; `digest` (the question's, as shown) binds the approval
        to it: refused (409) when the task now waits on something else."""
        body: dict[str, Any] = {"approved": approved, **({"always": always} if always else {}),
                                **({"digest": digest} if digest else {})}
        return self._request("POST", f"/tasks/{_quote(task_id)}/approval", json=body)

    def approvals(self) -> list[dict[str, Any]]:
        """What waits for a person that this token may answer (GET /approvals; docs/approvals.md)."""
        return self._request("GET", "/approvals")

    def webhooks(self) -> list[dict[str, Any]]:
        """This token's webhooks (an admin's: every one), secrets never included."""
        return self._request("GET", "/webhooks")

    def add_webhook(self, url: str, *, events: list[str] | None = None, fmt: str = "generic",
                    server_wide: bool = False) -> dict[str, Any]:
        """Add a webhook; the answer's `secret` (its signing secret) is shown this once."""
        body: dict[str, Any] = {"url": url, "format": fmt, "server_wide": server_wide,
                                **({"events": events} if events else {})}
        return self._request("POST", "/webhooks", json=body)

    def remove_webhook(self, webhook_id: str) -> dict[str, Any]:
        return self._request("DELETE", f"/webhooks/{_quote(webhook_id)}")

    def webhook_deliveries(self, webhook_id: str, limit: int = 50) -> list[dict[str, Any]]:
        """The webhook's latest deliveries, newest first (status, attempts, last HTTP status and error)."""
        return self._request("GET", f"/webhooks/{_quote(webhook_id)}/deliveries",
                             params={"limit": limit})

    def test_webhook(self, webhook_id: str) -> dict[str, Any]:
        """Queue a `ping` delivery to the webhook."""
        return self._request("POST", f"/webhooks/{_quote(webhook_id)}/test")

    def cancel(self, task_id: str) -> dict[str, Any]:
        return self._request("POST", f"/tasks/{_quote(task_id)}/cancel")

    def edit_task(self, task_id: str, edit: dict[str, Any]) -> dict[str, Any]:
        """Edit the task's running graph ({add, remove, add_needs}); see `tether.client.Client.edit_task`."""
        return self._request("POST", f"/tasks/{_quote(task_id)}/edits", json=edit)

    def undo_task(self, task_id: str) -> dict[str, Any]:
        """Put back the files the task changed on every device it ran on: {task, devices: {name: report}}."""
        return self._request("POST", f"/tasks/{_quote(task_id)}/undo", timeout=httpx.Timeout(300, connect=10))

    def task_events(self, task_id: str, after: int = -1, *, patience: float = 60.0, backoff: float = 0.5,
                    on_gone: Callable[[str], None] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """A task's events as ("task_event", TaskEvent JSON) pairs, then ("end", {id, state, ended, ...}).

        The stream starts after event `after`. When it drops before the task has ended (a network
        cut, or a server that stopped under the task: `end` with `ended` false), it is opened again
        with `after` set to the last event's `seq`, so no event is yielded twice or lost; the pause
        between tries grows from `backoff` to at most 5 s. `on_gone(problem)` is called once each time
        the server goes away. While it stays away (no stream opens) for more than `patience` seconds:
        RemoteError with status None, naming the task. The final ("end", ...) is yielded once."""
        last = after
        gone_since: float | None = None
        failures = 0
        while True:
            problem = ""
            try:
                with self._http.stream("GET", f"/tasks/{_quote(task_id)}/events", params={"after": last},
                                       headers={"Accept": "text/event-stream"},
                                       timeout=httpx.Timeout(60, connect=10)) as response:
                    if response.is_error:
                        response.read()
                        if response.status_code not in (502, 503, 504):  # not a server (re)starting
                            self._decode(response)
                        raise httpx.TransportError(f"HTTP {response.status_code}")
                    gone_since, failures = None, 0  # back: the outage, if any, is over
                    for event, data in iter_sse(response.iter_lines()):
                        if event == "task_event":
                            if data.get("seq", -1) <= last:
                                continue  # seen before the reconnection
                            last = data["seq"]
                            yield event, data
                        elif event == "end":
                            if data.get("ended", True):
                                yield event, data
                                return
                            problem = f"the server stopped while the task was {data.get('state')}"
                            break
                    else:
                        problem = "the server closed the event stream"
            except httpx.HTTPError as exc:
                problem = f"lost the connection to {self.base_url}: {exc}"
            now = time.monotonic()
            if gone_since is None:
                gone_since = now
                if on_gone is not None:
                    on_gone(problem)
            elif now - gone_since > patience:
                raise RemoteError(f"{problem}; gave up following task {task_id} after {patience:g} s without "
                                  "the server (the task goes on on the server)")
            failures += 1
            time.sleep(min(backoff * 2 ** (failures - 1), 5.0))  # a pause before reconnecting, not a wait


def _look_up(named: list[str]) -> str:
    """The words that name a batch and how to look its outcome up, when the server named it."""
    return (f"; batch {named[0]}: the command may have gone on on the device; its outcome: tether batch {named[0]}"
            if named else "")


def _quote(part: str) -> str:
    """`part` as one path segment: every `/`, `%`, `?`, `#`, `..` and control character percent-encoded, so a name
    from a script's input never leads to another resource; bytes of another encoding (Python's surrogate escapes
    of a command-line argument) are sent as the bytes they were, and the server answers for that name."""
    from urllib.parse import quote

    return quote(part, safe="", errors="surrogateescape")

