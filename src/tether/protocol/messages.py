"""AIP envelopes (seeds 000-002). One message type per purpose; every frame is versioned and timed.

A `ServerMessage` goes server → device and a `ClientMessage` device → server. Each type has the
fields it needs checked at decode time, so a handler never meets a COMMAND without actions or
results without the `prev_response_id` they answer.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tether.protocol.identity import KeyProof
from tether.protocol.models import Command, Result
from tether.protocol.profile import DeviceProfile

PROTOCOL_VERSION = "1.0"


def utc_now() -> str:
    return datetime.now(UTC).isoformat()


class ServerMessageType(str, Enum):
    REGISTER_ACK = "register_ack"  # registration accepted; payload: RegisterAck
    REGISTER_REFUSED = "register_refused"  # registration refused; `error` says why; the socket closes
    HEARTBEAT = "heartbeat"  # the server's answer to a device heartbeat
    COMMAND = "command"  # a batch: `actions`, `response_id`, `timeout`, `early_exit`
    CANCEL = "cancel"  # stop the batch `response_id` and kill what it started
    DEVICE_INFO_REQUEST = "device_info_request"  # ask for a fresh profile
    POLICY_REQUEST = "policy_request"  # ask for the effective policy; answered by POLICY_REPORT
    POLICY_SET = "policy_set"  # change the policy; payload: {"policy": {...}, "replace": bool}; POLICY_REPORT
    # a person's answer to the question an external MCP server asked during the batch `response_id` (the
    # device's `elicitation` event); payload: {"id": question id, "action": accept|decline|cancel, "content": {...}}
    ELICITATION_ANSWER = "elicitation_answer"
    # answers a device's SAMPLING_REQUEST (`prev_response_id` there is `response_id` here): payload
    # {"text": …, "model": …}, or status FAILED with `error` (no LLM, refused, failed)
    SAMPLING_REPLY = "sampling_reply"
    # report-only: what became of earlier calls; payload {"calls": [{"call_id": …, "response_id": … or absent}]};
    # answered by OUTCOME_REPORT from the device's record of finished calls. The device never runs anything
    # for it. A device that predates it answers nothing (or an ERROR): the server counts that as `unknown`
    OUTCOME_QUERY = "outcome_query"
    ERROR = "error"  # the device sent a frame the server could not accept


class ClientMessageType(str, Enum):
    REGISTER = "register"  # first frame: payload is a Registration
    HEARTBEAT = "heartbeat"  # liveness + load {running, queued}; skipped while frames flow both ways, load unchanged
    COMMAND_RESULTS = "command_results"  # results for `prev_response_id`; status CONTINUE or COMPLETED
    EVENT = "event"  # progress / streamed output while a batch runs; payload: Event
    # a fresh profile; payload: DeviceProfile. Asked for (`prev_response_id`), or sent unasked when the device's
    # tools change (an external MCP server has joined after registration): the server replaces the profile
    DEVICE_INFO = "device_info"
    POLICY_REPORT = "policy_report"  # answers `prev_response_id`: payload {version, policy, sources,
    # remote_allowed}, or status FAILED with `error` (a refused or invalid change: nothing changed)
    # an external MCP server asks for an LLM completion during a command (its policy allows it): payload
    # {"server", "call_id", "messages": [{role, content}], "system_prompt", "max_tokens", "temperature"}
    SAMPLING_REQUEST = "sampling_request"
    # answers the OUTCOME_QUERY `prev_response_id`: payload {"outcomes": [CallOutcome, …]}, one per call asked
    OUTCOME_REPORT = "outcome_report"
    ERROR = "error"  # the server sent a frame the device could not accept


class TaskStatus(str, Enum):
    CONTINUE = "continue"  # more results for this batch will follow
    COMPLETED = "completed"  # the last results frame of a batch
    FAILED = "failed"
    OK = "ok"
    ERROR = "error"


class Registration(BaseModel):
    """A REGISTER payload. `name` is a claim the server checks against the token, never trusts."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    instance_id: str = Field(..., min_length=1, description="random per device process: tells a "
                             "reconnect of this process from a second process with the same token")
    profile: DeviceProfile = Field(default_factory=DeviceProfile)
    finished_call_ids: list[str] = Field(default_factory=list, description="results waiting in the outbox")
    proof: KeyProof | None = Field(None, description="the device's public key and its signature of "
                                   "identity.register_statement for the challenge this connection was given; "
                                   "a server that sent a challenge refuses a registration without it")


class RegisterAck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str
    heartbeat_interval: float
    heartbeat_timeout: float
    grace_period: float
    max_frame_bytes: int
    resumed: bool = False


class Event(BaseModel):
    """Something that happened while a batch runs: `kind` is e.g. output, progress, started."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    response_id: str | None = None
    call_id: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)


OutcomeState = Literal["finished", "running", "unknown"]
OUTCOME_FINISHED: OutcomeState = "finished"
OUTCOME_RUNNING: OutcomeState = "running"
OUTCOME_UNKNOWN: OutcomeState = "unknown"


class CallRef(BaseModel):
    """One call an OUTCOME_QUERY asks about: its `call_id` and, when known, the `response_id` of the batch
    that carried it (the device's record is keyed by both; without it, the call_id must be unambiguous)."""

    model_config = ConfigDict(extra="forbid")

    call_id: str = Field(..., min_length=1)
    response_id: str | None = None


class CallOutcome(BaseModel):
    """What a device knows of one call (an OUTCOME_REPORT entry): `finished` with its `result` (from the
    device's record of finished calls), `running` (its batch is queued or running now), or `unknown`
    (the device has no record of it: never received, or forgotten). `response_id` is the batch that
    carried it, when the device knows it."""

    model_config = ConfigDict(extra="forbid")

    call_id: str
    state: OutcomeState
    response_id: str | None = None
    result: Result | None = None
    note: str | None = Field(None, description="why the state is what it is, in words (e.g. why unknown)")

    @model_validator(mode="after")
    def _result_when_finished(self) -> CallOutcome:
        if (self.state == OUTCOME_FINISHED) != (self.result is not None):
            raise ValueError("a finished call carries its result, and only a finished one does")
        return self


class _Envelope(BaseModel):
    model_config = ConfigDict(extra="forbid")

    protocol_version: str = PROTOCOL_VERSION
    timestamp: str = Field(default_factory=utc_now)


class ServerMessage(_Envelope):
    """Server → device. A COMMAND carries `actions` and the `response_id` the results must echo."""

    type: ServerMessageType
    status: TaskStatus = TaskStatus.CONTINUE
    response_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    session_id: str | None = None
    task_name: str | None = None
    agent_name: str | None = None
    process_name: str | None = None
    root_name: str | None = None
    actions: list[Command] | None = None
    timeout: float | None = Field(None, gt=0)
    early_exit: bool = True
    error: str | None = None
    payload: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _fields_for_type(self) -> ServerMessage:
        if self.type is ServerMessageType.COMMAND and not self.actions:
            raise ValueError("a command message needs a non-empty 'actions' list")
        if self.type is ServerMessageType.REGISTER_REFUSED and not self.error:
            raise ValueError("a register_refused message needs an 'error'")
        if self.type is ServerMessageType.POLICY_SET and not isinstance((self.payload or {}).get("policy"), dict):
            raise ValueError("a policy_set message needs a payload with a 'policy' mapping")
        if self.type is ServerMessageType.OUTCOME_QUERY:
            calls = (self.payload or {}).get("calls")
            if not isinstance(calls, list) or not calls:
                raise ValueError("an outcome_query message needs a payload with a non-empty 'calls' list")
            for call in calls:
                CallRef.model_validate(call)
        return self


class ClientMessage(_Envelope):
    """Device → server. COMMAND_RESULTS carries `action_results` and `prev_response_id`."""

    type: ClientMessageType
    status: TaskStatus = TaskStatus.OK
    client_id: str | None = None
    session_id: str | None = None
    prev_response_id: str | None = None
    action_results: list[Result] | None = None
    error: str | None = None
    payload: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _fields_for_type(self) -> ClientMessage:
        if self.type is ClientMessageType.COMMAND_RESULTS:
            if not self.prev_response_id:
                raise ValueError("a command_results message needs 'prev_response_id'")
            if self.action_results is None:
                raise ValueError("a command_results message needs 'action_results'")
        if self.type is ClientMessageType.POLICY_REPORT and not self.prev_response_id:
            raise ValueError("a policy_report message needs 'prev_response_id'")
        if self.type is ClientMessageType.OUTCOME_REPORT:
            if not self.prev_response_id:
                raise ValueError("an outcome_report message needs 'prev_response_id'")
            outcomes = (self.payload or {}).get("outcomes")
            if not isinstance(outcomes, list):
                raise ValueError("an outcome_report message needs a payload with an 'outcomes' list")
            for outcome in outcomes:
                CallOutcome.model_validate(outcome)
        if self.type in (ClientMessageType.REGISTER, ClientMessageType.EVENT) and self.payload is None:
            raise ValueError(f"a {self.type.value} message needs a 'payload'")
        return self
