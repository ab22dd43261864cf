"""The typed answers of the REST API as `tether.Client` returns them.

The wire models (`Command`, `Result`, `Event`, `DeviceProfile`, `ToolInfo`) are the protocol's own; a
task and its events are the agent's (`tether.agent.run.task`). The models here describe the REST answers
that have no model elsewhere; unknown fields a newer server adds are kept (`extra="allow"`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tether.protocol.models import Result
from tether.protocol.profile import DeviceProfile

__all__ = ["AuditPage", "BatchResults", "Device", "DeviceDetail", "FanOutOutcome", "FanOutReport", "FanOutSummary",
           "TaskEnd", "TaskSummary"]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class Device(_Answer):
    """One row of `GET /api/v1/devices`: a device's name, status (online, busy, offline) and what it offers."""

    name: str
    status: str
    platform: str | None = None
    last_seen: float | None = None
    load: int = 0
    running: int = 0
    queued: int = 0
    capabilities: list[str] = Field(default_factory=list)
    tags: list[str] = Field(default_factory=list)
    gpu: bool = False
    address: str | None = None
    sandbox: str | None = None
    node: str | None = None


class DeviceDetail(Device):
    """`GET /api/v1/devices/{name}`: the row plus the profile the device registered with."""

    profile: DeviceProfile | None = None


class BatchResults(_Answer):
    """A batch's outcome: the device it ran on, one `Result` per command in order, and the batch's id
    (for `batch()`; None when the server did not say)."""

    device: str
    results: list[Result]
    batch: str | None = None


class FanOutOutcome(_Answer):
    """One device's line of a fan-out: `status` ok, failed, offline, timed_out or cancelled; `results`
    when the batch ran, else `error`."""

    device: str
    status: str
    results: list[Result] = Field(default_factory=list)
    error: str | None = None
    duration: float = 0.0


class FanOutSummary(_Answer):
    """How a fan-out ended: devices per status, their total and the seconds it took."""

    ok: int = 0
    failed: int = 0
    offline: int = 0
    timed_out: int = 0
    cancelled: int = 0
    total: int = 0
    duration: float = 0.0


class FanOutReport(_Answer):
    """A whole fan-out: its id, each device's outcome (in the order they ended) and the summary."""

    id: str
    devices: list[FanOutOutcome]
    summary: FanOutSummary


class TaskSummary(_Answer):
    """A task's short form (create, list, answer, approve, cancel): its state and the open question."""

    id: str
    request: str = ""
    state: str
    device: str | None = None
    requested_by: str | None = None
    cursor: int = 0
    steps: int = 0
    answer: str | None = None
    error: str | None = None
    question: dict[str, Any] | None = None
    created_at: str | None = None
    updated_at: str | None = None


class TaskEnd(_Answer):
    """The last event of a task's stream: its final state; `ended` is false when the server stopped
    while the task was still going."""

    id: str
    state: str
    ended: bool = True
    answer: str | None = None
    error: str | None = None


class AuditPage(_Answer):
    """Audit rows newest first; `next` is the `before` that reads the following page (None on the last)."""

    rows: list[dict[str, Any]]
    next: int | None = None
