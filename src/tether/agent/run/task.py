"""A task: one request in plain words, its plan, its cursor, and everything that happened to it.

Everything here is a plain pydantic model so a task serializes to JSON as it is (the durable store
will keep exactly this). The state machine (seed 002's server-side FSM):

    created → planning → running → (recovering | waiting_for_user) → done | failed | cancelled

`Task.transition` refuses any move the table below does not list (`InvalidTransition`), and every
move is recorded as a `state` event.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tether.agent.planning.plan import Plan, PlanStep
from tether.errors import AgentError
from tether.protocol.models import Command, Result


def _now() -> datetime:
    return datetime.now(UTC)


class TaskState(str, Enum):
    CREATED = "created"
    PLANNING = "planning"
    RUNNING = "running"
    RECOVERING = "recovering"
    WAITING_FOR_USER = "waiting_for_user"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # a local task whose tether process stopped mid-way (killed, the machine went down): found so at the
    # next start, it can only be cancelled or failed, never resumed (its questions had nobody to answer)
    INTERRUPTED = "interrupted"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES: frozenset[TaskState] = frozenset({TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED})
_ENDINGS = {TaskState.FAILED, TaskState.CANCELLED, TaskState.INTERRUPTED}

# Which state may follow which. Re-planning goes back through `planning`; every live state may fail
# or be cancelled; only `running` (the last step succeeded) may end in `done`.
TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    TaskState.CREATED: frozenset({TaskState.PLANNING, TaskState.RUNNING, TaskState.WAITING_FOR_USER, *_ENDINGS}),
    TaskState.PLANNING: frozenset({TaskState.RUNNING, TaskState.WAITING_FOR_USER, *_ENDINGS}),
    TaskState.RUNNING: frozenset({TaskState.RECOVERING, TaskState.WAITING_FOR_USER, TaskState.PLANNING,
                                  TaskState.DONE, *_ENDINGS}),
    TaskState.RECOVERING: frozenset({TaskState.RUNNING, TaskState.PLANNING, TaskState.WAITING_FOR_USER,
                                     *_ENDINGS}),
    TaskState.WAITING_FOR_USER: frozenset({TaskState.RUNNING, TaskState.PLANNING, *_ENDINGS}),
    TaskState.DONE: frozenset(),
    TaskState.FAILED: frozenset(),
    TaskState.CANCELLED: frozenset(),
    TaskState.INTERRUPTED: frozenset({TaskState.FAILED, TaskState.CANCELLED}),
}


class InvalidTransition(AgentError, RuntimeError):
    """A state change the task state machine does not allow."""

    def __init__(self, current: TaskState, target: TaskState) -> None:
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[current])) or "none (the task has ended)"
        super().__init__(f"a task cannot go from {current.value} to {target.value} (allowed: {allowed})")
        self.current = current
        self.target = target


class Budgets(BaseModel):
    """Limits that end a task in ASK_USER or failure instead of a loop."""

    model_config = ConfigDict(extra="forbid")

    patches_per_step: int = Field(2, ge=0)
    replans_per_task: int = Field(2, ge=0)
    total_steps: int = Field(50, ge=1, description="commands sent for the whole task, retries included")
    wall_time_s: float = Field(600.0, gt=0, description="working time; waiting for a person is not counted")
    observe_rounds_per_task: int = Field(8, ge=0, description="times a plan may stop at `observe` to plan on")
    parallel_steps: int = Field(4, ge=1, description="a graph plan's steps running at once (one per device)")


class TaskEvent(BaseModel):
    """Something that happened to a task: a state change, a step, streamed output, a question, a token."""

    model_config = ConfigDict(extra="forbid")

    seq: int = 0
    kind: str
    data: dict[str, Any] = Field(default_factory=dict)
    at: datetime = Field(default_factory=_now)


class StepRecord(BaseModel):
    """One command sent for one plan step, its result, and the recovery decision taken on a failure."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(..., description="the plan step (cursor) this attempt ran")
    attempt: int = 1
    step: PlanStep
    command: Command
    result: Result
    decision: dict[str, Any] | None = Field(default=None, description="the recovery decision, if it failed")
    started_at: datetime = Field(default_factory=_now)
    finished_at: datetime = Field(default_factory=_now)


class Question(BaseModel):
    """An ASK_USER question (or an approval) and, once given, its answer."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    step: int | None = None
    question: str
    options: list[str]
    kind: str = "question"
    changes: list[dict[str, Any]] = Field(default_factory=list,
                                          description="an approval of a command's held changes: exactly those")
    digest: str | None = Field(default=None, description=(
        "an approval or a plan to confirm: the digest of what it shows (the device's for a command: argv, cwd, "
        "env, program and script hashes, held changes); the approval is bound to it"))
    answer: str | None = None
    answered_by: str | None = None
    asked_at: datetime = Field(default_factory=_now)
    answered_at: datetime | None = None


class Counters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    commands: int = 0
    replans: int = 0
    observe_rounds: int = 0
    patches: dict[str, int] = Field(default_factory=dict, description="AUTO_PATCHes applied, by step index")
    tried_args: dict[str, list[dict[str, Any]]] = Field(
        default_factory=dict, description="the arguments each step has been run with, by step index")
    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0


class TaskAsker(BaseModel):
    """The API token a task acts for: the one that created it (a person's, or an agent's when `agent`).
    The questions its steps raise are this token's, as a plain command's are its caller's
    (`tether.server.trust.approvals.check_answerer`): saved with the task, so a restart keeps it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(..., min_length=1, max_length=128)
    agent: bool = False
    sample: bool = Field(default=False, description="the token held the `sample` scope: the task's MCP servers may "
                                                    "use the server's LLM")


class Task(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    request: str = ""
    device: str | None = Field(default=None, description="the device steps run on unless they name another")
    devices: list[str] = Field(default_factory=list, description="other devices the task's steps may name")
    requested_by: str | None = Field(default=None, description="who created the task (an API token's name)")
    asker: TaskAsker | None = Field(default=None, description="the token the task acts for, whose questions its "
                                    "steps raise (None: a task made without a token, or before tasks recorded it)")
    scope_devices: list[str] = Field(default_factory=list, description="the creating token's device scope (names "
                                     "or globs): the only devices the task's commands may reach; with scope_tags "
                                     "empty too, every device")
    scope_tags: list[str] = Field(default_factory=list, description="... and the devices with one of these tags")
    confirm: str = Field(default="never", description="never|destructive|always: which plans a person confirms "
                                                      "before they run")
    plan: Plan | None = None
    cursor: int = 0
    step_states: list[str] = Field(default_factory=list, description=(
        "a graph plan: each step's state by index (pending, running, done, failed, skipped, replaced, removed)"))
    step_devices: dict[str, str] = Field(default_factory=dict, description=(
        "a graph plan: the device chosen for each step that named requires instead of a device, by index"))
    state: TaskState = TaskState.CREATED
    steps: list[StepRecord] = Field(default_factory=list)
    questions: list[Question] = Field(default_factory=list)
    counters: Counters = Field(default_factory=Counters)
    events: list[TaskEvent] = Field(default_factory=list)
    approved_step: int | None = Field(default=None, description="the step the user approved, sent once approved")
    approved_by: str | None = Field(default=None, description="who approved it (the command carries the name)")
    approved_digest: str | None = Field(default=None, description="the digest of what they approved (the command "
                                                                  "carries it; the device compares)")
    answer: str | None = None
    error: str | None = None
    created_at: datetime = Field(default_factory=_now)
    updated_at: datetime = Field(default_factory=_now)

    def can_transition(self, target: TaskState) -> bool:
        return target in TRANSITIONS[self.state]

    def transition(self, target: TaskState, **data: Any) -> TaskEvent | None:
        """Move to `target` (a no-op when already there); `InvalidTransition` when not allowed."""
        if target is self.state:
            return None
        if target not in TRANSITIONS[self.state]:
            raise InvalidTransition(self.state, target)
        previous = self.state
        self.state = target
        return self.record("state", {"from": previous.value, "to": target.value, **data})

    def record(self, kind: str, data: dict[str, Any] | None = None, *, seq: int | None = None) -> TaskEvent:
        """Append an event; `seq` only ever grows (a restart may move it on, see `tether.agent.tasks.restart`)."""
        following = self.events[-1].seq + 1 if self.events else 0
        event = TaskEvent(seq=following if seq is None else max(seq, following), kind=kind, data=data or {})
        self.events.append(event)
        self.updated_at = event.at
        return event

    @property
    def pending_question(self) -> Question | None:
        if self.questions and self.questions[-1].answer is None:
            return self.questions[-1]
        return None

    def records_for(self, index: int) -> list[StepRecord]:
        return [r for r in self.steps if r.index == index]

    def devices_used(self) -> list[str]:
        """The devices this task's commands were sent to, in first-use order (what an undo must visit)."""
        names = [r.step.device or self.device for r in self.steps]
        return list(dict.fromkeys(n for n in names if n))

    def devices_undo_order(self) -> list[str]:
        """The devices this task's commands were sent to, the one used last first: the order an undo puts
        their changes back in (the reverse of the order they were made)."""
        names = [r.step.device or self.device for r in sorted(self.steps, key=lambda r: r.finished_at)]
        return list(dict.fromkeys(n for n in reversed(names) if n))

    def summary(self) -> dict[str, Any]:
        """The short form lists show: no events, no step records."""
        pending = self.pending_question
        return {"id": self.id, "request": self.request, "state": self.state.value, "device": self.device,
                "requested_by": self.requested_by, "cursor": self.cursor,
                "asker": self.asker.model_dump() if self.asker is not None else None,
                "steps": len(self.plan.steps) if self.plan else 0, "answer": self.answer, "error": self.error,
                "question": pending.model_dump(mode="json") if pending else None,
                "created_at": self.created_at.isoformat(), "updated_at": self.updated_at.isoformat()}
