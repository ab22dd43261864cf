"""What external MCP servers ask through a device while a batch runs, and who answers.

An elicitation (a question for a person) arrives as an event of the batch — an external MCP server's, or
the device's own about a host a sandboxed command asks to reach (`ask: on-miss`); `OpenQuestions` remembers
which batch of which device asked it, so that a person's answer (`tether answer`, the dashboard) goes
to the batch still waiting for it and to no other; whether it asks for consent (`asks_consent`) decides
whether, with four-eyes on, its caller may answer it (server/trust/approvals.py `check_answerer`). A sampling
request (a completion from the server's LLM) is charged to the command it says it serves: `SamplingGate`
admits it only for a call of a batch running on that device whose caller's token holds the `sample` scope,
within caps per call and per token and minute; `answer_sampling` then asks the sampler the agent layer
sets (bounded in time, within size caps), refuses with a reason otherwise, and audits either outcome with
the caller (docs/security/approvals.md, "Sampling").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from tether.protocol.messages import ClientMessage, Event, ServerMessage, ServerMessageType, TaskStatus
from tether.server.aip.batches.ledger import PendingBatch, TokenRef
from tether.server.aip.sockets.link import DeviceLink

if TYPE_CHECKING:
    from tether.server.store.audit import AuditLog

MAX_OPEN_QUESTIONS = 1024  # elicitation questions remembered for answers, over all devices
SAMPLING_TIMEOUT = 120.0  # a device's sampling request to the server's LLM
SAMPLING_PER_CALL = 5  # sampling requests one command's call may cause (the device's own budget, held here too)
SAMPLING_PER_MINUTE = 30  # sampling requests one token's commands may cause together in any 60 s
SAMPLING_MAX_CHARS = 64_000  # the messages and system prompt of one request, together
SAMPLING_MAX_MESSAGES = 200
SAMPLING_SCOPE = "sample"  # the token scope a command's caller needs for its MCP servers to sample
_SAMPLING_CALLS_KEPT = 4096  # calls whose sampling count is remembered (the oldest go first)

# the answers to a question that asks for nothing but a yes or no (an enum of these words is a decision)
CONSENT_WORDS = frozenset({"yes", "no", "y", "n", "approve", "approved", "deny", "denied", "allow", "reject",
                           "accept", "decline", "confirm", "confirmed", "cancel", "ok", "proceed", "abort",
                           "once", "always"})  # "once"/"always": an approval for now or for good (egress ask)

Sampler = Callable[[str, dict[str, Any]], Awaitable[tuple[str, str]]]  # (device, request) → (text, model)

logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name


def asks_consent(schema: Any) -> bool:
    """Whether a question with this answer schema asks a person for consent (an approval) rather than for
    information: it asks for no field at all (accepting is the yes), or only for booleans (a confirmation),
    or for one choice among decision words ("approve"/"deny", "yes"/"no", `CONSENT_WORDS`). A form with
    any other field (a text, a number, a choice of other things) asks for information."""
    if not isinstance(schema, dict):
        return True
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not properties:
        return True
    kinds = [p if isinstance(p, dict) else {} for p in properties.values()]
    if all(p.get("type") == "boolean" for p in kinds):
        return True
    if len(kinds) == 1:
        options = kinds[0].get("enum") or [o.get("const") for o in kinds[0].get("oneOf") or [] if isinstance(o, dict)]
        return bool(options) and all(isinstance(o, str) and o.strip().lower() in CONSENT_WORDS for o in options)
    return False


class OpenQuestions:
    """(device, question id) → the response_id of the batch that asked and whether the question asks for
    consent (`asks_consent`); the oldest go first when full."""

    def __init__(self, limit: int = MAX_OPEN_QUESTIONS) -> None:
        self.limit = limit
        # (device, question) -> (response_id, asks consent, the host a sandboxed command asks to reach or None)
        self._open: dict[tuple[str, str], tuple[str, bool, dict[str, Any] | None]] = {}
        self._shown: dict[tuple[str, str], dict[str, Any]] = {}  # what the inbox shows of each (`listed`)

    def note(self, device: str, event: Event) -> None:
        """Remember a question the event asks, forget one it says was answered."""
        question = str(event.data.get("id", ""))[:64]
        if event.kind == "elicitation" and question and "declined" not in event.data:
            if len(self._open) >= self.limit:  # answered or not, the oldest go first
                self.forget(*next(iter(self._open)))
            egress = event.data.get("egress")
            target = {"host": str(egress.get("host"))[:255], "port": egress.get("port")} \
                if isinstance(egress, dict) else None
            self._open[(device, question)] = (event.response_id or "", asks_consent(event.data.get("schema")), target)
            self._shown[(device, question)] = {
                "device": device, "id": question, "approval": asks_consent(event.data.get("schema")),
                "message": str(event.data.get("message", ""))[:2000], "server": event.data.get("server"),
                "asker": event.data.get("asker"), "asker_agent": event.data.get("asker_agent"),
                "schema": event.data.get("schema"), "batch": event.response_id, "at": time.time()}
        elif event.kind == "elicitation_answered":
            self.forget(device, question)

    def listed(self) -> list[dict[str, Any]]:
        """Every open question, oldest first: device, id, approval (asks for consent), message, server, asker,
        asker_agent, schema, batch and when it was asked (`at`)."""
        return [dict(shown) for shown in self._shown.values()]

    def batch_of(self, device: str, question: str) -> str | None:
        """The response_id of the batch that asked this open question, or None."""
        entry = self._open.get((device, question))
        return entry[0] if entry is not None else None

    def consent(self, device: str, question: str) -> bool:
        """Whether this open question asks for consent (`asks_consent`); True for one not known here."""
        entry = self._open.get((device, question))
        return entry[1] if entry is not None else True

    def egress(self, device: str, question: str) -> dict[str, Any] | None:
        """The host and port of an open `ask: on-miss` question (tools/shell/egress_ask.py), else None."""
        entry = self._open.get((device, question))
        return entry[2] if entry is not None else None

    def forget(self, device: str, question: str) -> None:
        self._open.pop((device, question), None)
        self._shown.pop((device, question), None)


class SamplingGate:
    """Who may cause a sampling request, and how many: the one place the server decides, whatever the
    device says (its own per-command budget is the device's word; a device is not trusted with the server's
    LLM). `clock` is for tests of the per-minute cap."""

    def __init__(self, per_call: int = SAMPLING_PER_CALL, per_minute: int = SAMPLING_PER_MINUTE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_call, self.per_minute, self.clock = per_call, per_minute, clock
        self._calls: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._recent: dict[str, deque[float]] = {}

    def admit(self, device: str, call_id: str, batch: PendingBatch | None) -> str | None:
        """None when the request of `device` for its call `call_id` may go to the LLM (and it is counted);
        else why not, in words for the MCP server, the person and the audit. `batch` is the batch running
        on `device` that still waits for `call_id` (None: no such batch)."""
        if batch is None:
            return (f"sampling refused: no command is running on device {device} with call {call_id[:64] or '-'}, "
                    "so there is no caller to charge it to")
        caller = batch.asker
        if caller is None:
            return ("sampling refused: this command was not sent with an API token (an internal command, or a task "
                    f"saved before tasks recorded their token), and only a token holding the '{SAMPLING_SCOPE}' "
                    "scope may cause sampling")
        if not caller.sample:
            return (f"sampling refused: token '{caller.name}', whose command this is, does not allow its commands' "
                    f"MCP servers to use the server's LLM: it needs the '{SAMPLING_SCOPE}' scope (`tether token "
                    f"create --api NAME --scope execute --scope {SAMPLING_SCOPE}`); the LLM was not asked")
        used = self._calls.get((device, call_id), 0)
        if used >= self.per_call:
            return f"sampling refused: this call already caused {used} sampling requests (at most {self.per_call})"
        now = self.clock()
        recent = self._recent.setdefault(caller.name, deque())
        while recent and recent[0] <= now - 60.0:
            recent.popleft()
        if len(recent) >= self.per_minute:
            return (f"sampling refused: token '{caller.name}''s commands caused {len(recent)} sampling requests "
                    f"in the last minute (at most {self.per_minute}); try again later")
        recent.append(now)
        self._calls[(device, call_id)] = used + 1
        self._calls.move_to_end((device, call_id))
        if len(self._calls) > _SAMPLING_CALLS_KEPT:
            self._calls.popitem(last=False)
        return None


def sampling_size_problem(payload: dict[str, Any]) -> str | None:
    """Why a sampling request is too large to send the LLM (`SAMPLING_MAX_CHARS`, `SAMPLING_MAX_MESSAGES`),
    or None."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        return "sampling refused: the request has no messages"
    if len(messages) > SAMPLING_MAX_MESSAGES:
        return f"sampling refused: {len(messages)} messages (at most {SAMPLING_MAX_MESSAGES})"
    chars = len(str(payload.get("system_prompt") or "")) + sum(
        len(str(m.get("content", ""))) if isinstance(m, dict) else SAMPLING_MAX_CHARS for m in messages)
    if chars > SAMPLING_MAX_CHARS:
        return f"sampling refused: the messages are {chars} characters (at most {SAMPLING_MAX_CHARS})"
    return None


async def answer_sampling(sampler: Sampler | None, conn: DeviceLink, msg: ClientMessage, *,
                          refusal: str | None = None, caller: TokenRef | None = None,
                          audit: AuditLog | None = None) -> None:
    """One sampling request of an external MCP server on `conn`'s device: refused with `refusal` when the
    gate gave one (`SamplingGate.admit`), or when it is too large, else answered by the LLM. Audited in
    `audit` with the caller (`api:NAME`, the token whose command it served; `device:NAME` when none)."""
    payload = msg.payload or {}
    reply = ServerMessage(type=ServerMessageType.SAMPLING_REPLY, response_id=msg.prev_response_id or "-",
                          status=TaskStatus.OK)
    refusal = refusal or sampling_size_problem(payload)
    if refusal is not None:
        reply.status, reply.error = TaskStatus.FAILED, refusal
    elif sampler is None:
        reply.status, reply.error = TaskStatus.FAILED, "this server has no LLM configured"
    else:
        try:
            async with asyncio.timeout(SAMPLING_TIMEOUT):
                text, model = await sampler(conn.name, payload)
        except Exception as exc:
            reply.status, reply.error = TaskStatus.FAILED, f"the server's LLM failed: {exc}"[:1000]
        else:
            reply.payload = {"text": text, "model": model}
    logger.info("sampling for MCP server %s on device %s (call %s): %s", str(payload.get("server"))[:64],
                conn.name, str(payload.get("call_id"))[:64], reply.error or "answered")
    if audit is not None:
        listed = payload.get("messages")
        messages: list[Any] = listed if isinstance(listed, list) else []
        audit.record(f"api:{caller.name}" if caller is not None else f"device:{conn.name}", conn.name,
                     str(payload.get("call_id") or "")[:64] or None, "mcp.sampling",
                     {"server": str(payload.get("server"))[:64], "messages": len(messages),
                      "max_tokens": payload.get("max_tokens") if type(payload.get("max_tokens")) is int else None},
                     "failure" if reply.error else "success", reply.error)
    await conn.send(reply)
