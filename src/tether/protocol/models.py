"""The command layer's data: what is asked of a device and what comes back (seed 000)."""

from __future__ import annotations

import os
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ToolType = Literal["data_collection", "action"]
TOOL_TYPES: tuple[ToolType, ...] = ("data_collection", "action")


def new_call_id() -> str:
    """`uuid.uuid4().hex` (the same random version-4 UUID, as 32 hex digits) at a quarter of its cost:
    the server makes one for every batch it sends."""
    n = int.from_bytes(os.urandom(16), "big") & _UUID4_CLEAR | _UUID4_SET
    return f"{n:032x}"


_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))  # the version and variant bits, as uuid.UUID(version=4) sets them
_UUID4_SET = (4 << 76) | (0x8000 << 48)


class ResultStatus(str, Enum):
    """How a command ended; `none` means no result is available (yet): with `error` starting
    "outcome pending:" and `result` {"outcome": "pending", ...} (`Result.pending`), the caller's wait
    ended while the command may still be running, and its outcome is recorded when it comes."""

    SUCCESS = "success"
    FAILURE = "failure"
    SKIPPED = "skipped"
    NONE = "none"


OUTCOME_PENDING = "pending"  # `Result.result["outcome"]` (and the audit status) of an outcome still to come
OUTCOME_PENDING_PREFIX = "outcome pending:"


class Command(BaseModel):
    """One atomic tool call. `call_id` is assigned when missing so every result can be matched.

    `tool_type` may be left out: the device then finds the tool in whichever namespace has it
    (and says so when the name is ambiguous). `approved_by` records the human approval that an
    action the policy marks as dangerous needs; it is audited like everything else.
    """

    model_config = ConfigDict(extra="forbid")

    tool_name: str = Field(..., min_length=1, description="Name of the tool to execute")
    parameters: dict[str, Any] | None = Field(default=None, description="Parameters for the tool")
    tool_type: ToolType | None = Field(default=None, description="data_collection or action")
    call_id: str | None = Field(default=None, description="Unique identifier for this command call")
    timeout: float | None = Field(default=None, gt=0, description="Per-command timeout in seconds")
    approved_by: str | None = Field(default=None, description="Who approved this action, if it needed it")
    approval_digest: str | None = Field(default=None, description=(
        "with approved_by: the digest of what the person approved (the `approval_digest` of the needs-approval "
        "result they were shown); the device recomputes it before it runs or applies anything, and asks again "
        "when it differs"))

    @model_validator(mode="after")
    def _assign_call_id(self) -> Command:
        if not self.call_id:
            self.call_id = new_call_id()
        return self


class Result(BaseModel):
    """The outcome of one command; failures carry an `error` that says what went wrong."""

    model_config = ConfigDict(extra="forbid")

    status: ResultStatus = Field(..., description="Execution status")
    error: str | None = Field(default=None, description="Error message if failed")
    result: Any = Field(default=None, description="Result payload")
    namespace: str | None = Field(default=None, description="Namespace of the executed tool")
    call_id: str | None = Field(default=None, description="ID matching the Command.call_id")

    @property
    def ok(self) -> bool:
        return self.status is ResultStatus.SUCCESS

    @classmethod
    def failure(cls, error: str, call_id: str | None = None, namespace: str | None = None,
                result: Any = None) -> Result:
        return cls(status=ResultStatus.FAILURE, error=error, call_id=call_id, namespace=namespace,
                   result=result)

    @property
    def outcome_pending(self) -> bool:
        """The caller's wait ended while the command may still run: not a failure, see `Result.pending`."""
        return self.status is ResultStatus.NONE and isinstance(self.result, dict) \
            and self.result.get("outcome") == OUTCOME_PENDING

    @classmethod
    def pending(cls, why: str, call_id: str | None, batch_id: str, device: str) -> Result:
        """No outcome yet, honestly: the caller's wait ended (`why`) while the command may still be
        running on `device`. Status `none`, `error` "outcome pending: …" naming where the outcome will
        be (`GET /api/v1/batches/{batch_id}`, `tether batch {batch_id}`), and the same facts machine-
        readable in `result`: {"outcome": "pending", "batch_id", "call_id", "device", "reason"}."""
        error = (f"{OUTCOME_PENDING_PREFIX} {why}; the command may still be running on device {device}, and "
                 f"its outcome is recorded when it comes back: see batch {batch_id} (tether batch {batch_id}, "
                 f"GET /api/v1/batches/{batch_id}) or the audit log (call {call_id})")
        return cls(status=ResultStatus.NONE, error=error, call_id=call_id,
                   result={"outcome": OUTCOME_PENDING, "batch_id": batch_id, "call_id": call_id, "device": device,
                           "reason": why})

    @classmethod
    def skipped(cls, reason: str, call_id: str | None = None) -> Result:
        return cls(status=ResultStatus.SKIPPED, error=reason, call_id=call_id)


class ToolInfo(BaseModel):
    """What a tool is and how to call it; what `list_tools` returns and planners read."""

    model_config = ConfigDict(extra="forbid")

    name: str
    namespace: str
    tool_type: ToolType
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    output_schema: dict[str, Any] | None = None
    meta: bool = False
    # an external MCP server's own `title` and `annotations` (readOnlyHint, destructiveHint, idempotentHint,
    # openWorldHint, ...) as it gave them; None for tether's tools. Never in a ToolInfo's own dump: a server or
    # device of an earlier version refuses fields it does not know here (extra="forbid"), so they travel only
    # in a DeviceProfile's `tool_hints` (profile.py), which every version accepts
    title: str | None = Field(None, exclude=True)
    annotations: dict[str, Any] | None = Field(None, exclude=True)

    def hints(self) -> dict[str, Any]:
        """The title and annotations this tool has (only those set): what `DeviceProfile.tool_hints` carries."""
        return {k: v for k, v in (("title", self.title), ("annotations", self.annotations)) if v is not None}

    @property
    def key(self) -> str:
        return f"{self.tool_type}::{self.name}"
