"""One device tool call through the gateway: the REST path's dispatcher, policy, approvals and audit.

The command goes out through `hub.dispatcher(...)` exactly as `POST /api/v1/devices/{name}/commands` sends
it; the audit row's `requested_by` is `mcp:CLIENT/VERSION by api:TOKEN`, so the audit's token filter finds
it with the token's REST commands. While it runs, each event of the batch (streamed output, an external MCP
server's progress) becomes a progress notification when the client gave a progress token. The client's
`notifications/cancelled` cancels the handler; the batch then runs on in its own task only long enough to
be cancelled on the device (its processes killed) and audited, as when an HTTP caller goes away.

A command the device's policy holds for a person (`needs_approval`) is asked of the client through
elicitation when it declared that capability and the token is a person's holding `approve` (an agent's
token never approves: its client answering would be the agent approving itself); otherwise the call
returns at once with a tool error that names the question and how a person can answer it. The approved
re-run carries the digest of what was asked about, so the device runs it only if nothing changed since.
Nothing waits forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import posixpath
from dataclasses import dataclass
from typing import Any

from tether.errors import ServerError
from tether.protocol.messages import Event
from tether.protocol.models import Command, Result, new_call_id
from tether.server.aip import policy_push
from tether.server.aip.batches.ledger import TokenRef
from tether.server.aip.hub import DeviceHub
from tether.server.aip.questions.asked import asks_consent
from tether.server.mcp.contributed import Elicit, Progress
from tether.server.mcp.listing import DeviceTool
from tether.server.store.audit import AuditLog
from tether.server.store.tokens import TokenInfo
from tether.server.trust.approvals import (
    ApprovalRefused,
    check_approver,
    check_four_eyes,
    how_a_person_approves,
    server_url,
)

logger = logging.getLogger(__name__)

MAX_EVENTS = 10_000  # queued for the client while it reads; past it, events are dropped (the result is not)
MAX_PROGRESS_TEXT = 4000
CANCEL_GRACE = 15.0  # how long a cancelled call waits for its batch to be cancelled on the device and audited
MAX_BATCH_SECONDS = 24 * 3600  # the REST API's limit for one batch
APPROVE, DENY = "approve once", "deny"


@dataclass(frozen=True)
class Reply:
    """What becomes the CallToolResult: `payload` as structured content when it is an object."""

    text: str
    payload: Any = None
    is_error: bool = False


@dataclass(frozen=True)
class Caller:
    token: TokenInfo
    client: str  # "name/version" from the client's initialize

    @property
    def requested_by(self) -> str:
        return f"mcp:{self.client} by api:{self.token.name}"

    @property
    def ref(self) -> TokenRef:
        """The caller's token as a batch records it (whose its MCP servers' questions are)."""
        return TokenRef.of(self.token)


class AskLater(ServerError):
    """Raised by the `elicit` of a client that answers questions by retrying its call (the 2026-07-28
    protocol's input-required result) instead of being asked while the call waits; `held` is the result
    the question is about, so the retry goes straight to the answer."""

    def __init__(self, message: str, schema: dict[str, Any]) -> None:
        super().__init__(message)
        self.message, self.schema = message, schema
        self.held: Result | None = None


async def call_device_tool(hub: DeviceHub, tool: DeviceTool, arguments: dict[str, Any], caller: Caller,
                           progress: Progress, elicit: Elicit | None, *, audit: AuditLog,
                           held: Result | None = None) -> Reply:
    """Run the call; `held` (the retry of a call asked about with `AskLater`) skips to its approval; a
    policy change that an approval makes is recorded in `audit`."""
    if not caller.token.allows("execute"):
        return Reply(f"token '{caller.token.name}' lacks the 'execute' scope needed to call device tools; create "
                     "one with 'tether token create --api NAME --scope execute'", is_error=True)
    result = held or await _run(hub, tool, arguments, caller, progress, elicit, approved_by=None)
    if _needs_approval(result):
        approved = await _approval(hub, audit, tool, arguments, caller, progress, elicit, result)
        if isinstance(approved, Reply):
            return approved
        result = approved
    return result_reply(result)


async def _approval(hub: DeviceHub, audit: AuditLog, tool: DeviceTool, arguments: dict[str, Any], caller: Caller,
                    progress: Progress, elicit: Elicit | None, held: Result) -> Result | Reply:
    question = held.error or "this command needs a person's approval"
    how = (f"a person can run it with `tether exec --device {tool.device} {tool.info.name} ... --approve` or "
           f"allow it in the device's policy (`tether policy allow --device {tool.device} PROGRAM`)")
    if elicit is None:
        return Reply(f"{question}\nThis MCP client cannot be asked (it did not declare the elicitation "
                     f"capability), so nothing was run: {how}.", held.result, is_error=True)
    try:  # the client's answer is its token's: an agent's never approves (nor, with four-eyes, the asker's)
        check_approver(caller.token, f"approve {tool.info.name} on device {tool.device}",
                       how_a_person_approves(server_url(hub.settings), device=tool.device, tool=tool.info.name))
        check_four_eyes(bool(getattr(hub.settings, "four_eyes", False)), caller.requested_by, caller.requested_by,
                        f"approve {tool.info.name} on device {tool.device}")
    except ApprovalRefused as exc:
        return Reply(f"{question}\nNothing was run: {exc}.", held.result, is_error=True)
    always = _always_options(tool, arguments, held) if caller.token.allows("admin") else {}
    schema = {"type": "object", "required": ["decision"], "properties": {"decision": {
        "type": "string", "title": "Decision", "enum": [APPROVE, *always, DENY],
        "description": f"{tool.info.name} on device {tool.device}"}}}
    try:
        answer = await elicit(f"Device {tool.device}: {question}", schema)
    except AskLater as later:
        later.held = held
        raise
    except Exception as exc:  # the client failed to answer: the command stays unrun
        logger.warning("MCP gateway: elicitation for %s on %s failed: %s", tool.info.name, tool.device, exc)
        return Reply(f"{question}\nThe client could not be asked ({exc}); nothing was run: {how}.", held.result,
                     is_error=True)
    decision = (answer.get("content") or {}).get("decision")
    if answer.get("action") != "accept" or (decision != APPROVE and decision not in always):
        outcome = "denied" if decision == DENY else {"decline": "declined", "cancel": "cancelled"}.get(
            str(answer.get("action")), "not given")
        return Reply(f"not run: the approval was {outcome} "
                     f"({question})", {"denied": True, **(held.result if isinstance(held.result, dict) else {})},
                     is_error=True)
    if decision in always:  # the program (or program + subcommand) joins the device's allowlist first
        try:
            await policy_push.change(hub, tool.device, {"commands": always[decision]}, replace=False,
                                     requested_by=caller.requested_by, audit=audit)
        except policy_push.PolicyRequestFailed as exc:
            return Reply(f"not run: the device's policy could not be changed ({exc})", held.result, is_error=True)
    digest = held.result.get("approval_digest") if isinstance(held.result, dict) else None
    return await _run(hub, tool, arguments, caller, progress, elicit, approved_by=caller.requested_by,
                      approval_digest=digest if isinstance(digest, str) else None)


def _always_options(tool: DeviceTool, arguments: dict[str, Any], held: Result) -> dict[str, dict[str, Any]]:
    """For a shell command outside the allowlist (ask on miss), the answers that allow it from now on, as
    `tether exec --always` and the dashboard offer them: the program, or the program with this subcommand."""
    rule = held.result.get("rule") if isinstance(held.result, dict) else None
    cmd = arguments.get("cmd")
    if rule != "ask.on-miss" or not tool.info.name.startswith(("shell.", "shell_")) or not isinstance(cmd, str):
        return {}
    program = posixpath.basename(cmd.strip())
    if not program or any(c.isspace() for c in program):
        return {}
    options: dict[str, dict[str, Any]] = {f"always allow {program}": {program: {}}}
    argv = arguments.get("argv", arguments.get("args")) or []
    first = next((a for a in argv if isinstance(a, str) and a and not a.startswith("-")), None) \
        if isinstance(argv, list) else None
    if first is not None and len(first) <= 100:
        options[f"always allow {program} {first}"] = {program: {"subcommands": [first]}}
    return options


def _needs_approval(result: Result) -> bool:
    return not result.ok and isinstance(result.result, dict) and result.result.get("needs_approval") is True


async def _run(hub: DeviceHub, tool: DeviceTool, arguments: dict[str, Any], caller: Caller, progress: Progress,
               elicit: Elicit | None, approved_by: str | None, approval_digest: str | None = None) -> Result:
    """One batch of one command; its events forwarded while it runs; cancelled on the device if we are.

    The batch runs in its own task: when the client cancels, this handler's awaits are cancelled again and
    again by the SDK's cancel scope, while the batch's task can still tell the device and write the audit.
    Events go to a forwarding task made at the first one, so a command without events costs no more."""
    forward = _Forwarder(hub, tool.device, caller, progress, elicit)
    command = Command(tool_name=tool.info.name, tool_type=tool.info.tool_type, parameters=arguments,
                      approved_by=approved_by, approval_digest=approval_digest)
    dispatcher = hub.dispatcher(tool.device, on_event=forward.put, requested_by=caller.requested_by,
                                asker=caller.ref)
    run = asyncio.ensure_future(dispatcher.execute_commands([command], timeout=_batch_timeout(hub, arguments),
                                                            response_id=new_call_id()))
    try:
        [result] = await asyncio.shield(run)
        await forward.drain()  # every notification before the answer
        return result
    except asyncio.CancelledError:
        if not run.done():  # the client cancelled: the device must stop, and the audit say why
            run.cancel(f"cancelled by the MCP client ({caller.requested_by})")
            await _settle(run)
        raise
    finally:
        forward.close()


def _batch_timeout(hub: DeviceHub, arguments: dict[str, Any]) -> float:
    """The server's default, or longer when the call asks its tool for more (`timeoutMs`, as shell.run takes
    it): one second more than the tool's own, so the tool, which says what it killed, answers first."""
    timeout = hub.settings.default_command_timeout
    wanted = arguments.get("timeoutMs")
    if isinstance(wanted, int | float) and not isinstance(wanted, bool) and wanted > 0:
        timeout = max(timeout, min(wanted / 1000 + 1, MAX_BATCH_SECONDS))
    return timeout


async def _settle(run: asyncio.Future[Any]) -> None:
    """Wait (bounded, and shielded from the cancellation being delivered) for a cancelled batch to end."""
    import anyio

    with anyio.CancelScope(shield=True):
        await asyncio.wait({run}, timeout=CANCEL_GRACE)


class _Forwarder:
    """Turns a batch's events into progress notifications, and an external MCP server's question into an
    elicitation of this client (when it can be asked and the token may answer)."""

    def __init__(self, hub: DeviceHub, device: str, caller: Caller, progress: Progress,
                 elicit: Elicit | None) -> None:
        self.hub, self.device, self.caller, self.progress, self.elicit = hub, device, caller, progress, elicit
        self.count = 0.0  # the last progress value sent
        self.events: asyncio.Queue[Event | None] | None = None
        self.sender: asyncio.Task[None] | None = None
        self.questions: set[asyncio.Task[None]] = set()

    def put(self, event: Event) -> None:
        """The batch's `on_event` (called from the hub's receive loop: it must not block)."""
        if self.events is None:
            self.events = asyncio.Queue(maxsize=MAX_EVENTS)
            self.sender = asyncio.ensure_future(self._send_all(self.events))
        if self.events.qsize() < MAX_EVENTS - 1:  # one place kept for the end
            chunk = event.data.get("data") if event.kind == "output" else None
            if isinstance(chunk, str) and len(chunk) > MAX_PROGRESS_TEXT:
                # only this much of it is ever sent: a client that does not read must not make the server
                # hold MAX_EVENTS whole output chunks (a command printing MBs a second fills them in moments)
                event = event.model_copy(update={"data": {**event.data, "data": chunk[:MAX_PROGRESS_TEXT]}})
            self.events.put_nowait(event)

    async def drain(self) -> None:
        if self.events is not None and self.sender is not None:
            self.events.put_nowait(None)
            await asyncio.wait({self.sender}, timeout=CANCEL_GRACE)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.cancel()
        for question in list(self.questions):  # the command ended: its questions are moot
            question.cancel()

    async def _send_all(self, events: asyncio.Queue[Event | None]) -> None:
        while (event := await events.get()) is not None:
            await self._send(event)

    async def _send(self, event: Event) -> None:
        # an answer is a person's (as POST /devices/{name}/questions/{id}): never an agent's client, nor under
        # four-eyes the caller's own to a question asking for consent (it asked for the command); a form
        # asking for information stays the caller's
        if event.kind == "elicitation" and self.elicit is not None and self.caller.token.allows("approve") \
                and not self.caller.token.agent and "declined" not in event.data \
                and not (getattr(self.hub.settings, "four_eyes", False) and asks_consent(event.data.get("schema"))):
            task = asyncio.ensure_future(self._ask(event.data))
            self.questions.add(task)  # asked beside the stream, so output keeps flowing while a person thinks
            task.add_done_callback(self.questions.discard)
        done, total, message = self._progress_of(event)
        try:
            await self.progress(done, total, message[:MAX_PROGRESS_TEXT] if message is not None else None)
        except Exception as exc:  # a client that stopped reading must not stop the command
            logger.debug("MCP gateway: progress notification dropped: %s", exc)

    def _progress_of(self, event: Event) -> tuple[float, float | None, str | None]:
        """The notification's progress, total and message: an external server's own progress as it sent it
        (its value, total and message) while its values increase; any other event (streamed output, a
        question) one step past the last value sent, without a total (MCP wants every value larger)."""
        data = event.data
        value, total = data.get("progress"), data.get("total")
        if event.kind == "progress" and isinstance(value, int | float) and not isinstance(value, bool) \
                and value > self.count:
            self.count = float(value)
            message = data.get("message")
            return self.count, float(total) if isinstance(total, int | float) and not isinstance(total, bool) \
                else None, message if isinstance(message, str) else None
        self.count = float(int(self.count) + 1)
        if event.kind == "progress" and isinstance(value, int | float):
            return self.count, None, _progress_text(data)
        if event.kind == "output":
            return self.count, None, str(data.get("data", ""))
        return self.count, None, f"{event.kind}: {json.dumps(data, default=str)}"

    async def _ask(self, data: dict[str, Any]) -> None:
        assert self.elicit is not None
        question = str(data.get("id", ""))[:64]
        asked = data.get("schema")
        schema: dict[str, Any] = asked if isinstance(asked, dict) else {"type": "object", "properties": {}}
        message = f"{data.get('server', 'an MCP server')} on device {self.device} asks: {data.get('message', '')}"
        try:
            try:
                answer = await self.elicit(message, schema)
            except AskLater:  # a 2026-07-28 client without the tasks extension: it cannot be asked mid-call,
                # so the server is told at once (cancel: nobody chose) instead of waiting out its timeout
                answer = {"action": "cancel", "content": None}
            await self.hub.answer_question(self.device, question, str(answer.get("action", "cancel")),
                                           answer.get("content"), by=self.caller.requested_by,
                                           answerer=self.caller.ref)
        except Exception as exc:
            logger.info("MCP gateway: question %s of device %s not answered through the client: %s", question,
                        self.device, exc)


def _progress_text(data: dict[str, Any]) -> str:
    total = data.get("total")
    done = f"{data['progress']:g}" + (f"/{total:g}" if isinstance(total, int | float) else "")
    where = f"{data.get('server', '')}.{data.get('tool', '')}".strip(".")
    return f"{where} {done}" + (f": {data['message']}" if data.get("message") else "")


def result_reply(result: Result) -> Reply:
    """A device's `Result` as what the client reads: its text (output as text, objects as JSON) and the
    object itself as structured content."""
    payload = result.result
    if result.outcome_pending:  # not a failure: retrying could run it twice (docs/outcomes.md)
        return Reply(result.error or "outcome pending", payload)
    if not result.ok:
        return Reply(result.error or f"failed ({result.status.value})", payload, is_error=True)
    if isinstance(payload, str):
        return Reply(payload, payload)
    if payload is None:
        return Reply("", None)
    return Reply(json.dumps(payload, ensure_ascii=False, default=str), payload)

