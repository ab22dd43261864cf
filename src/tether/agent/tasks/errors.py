"""`TaskError`: a request the task API must refuse, with the HTTP status that says why."""

from __future__ import annotations

from tether.errors import AgentError


class TaskError(AgentError):
    """A request the task API must refuse; `status` is the HTTP status that says why."""

    def __init__(self, status: int, message: str, holder: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.holder = holder  # the live node that runs the task, when that is why (a cluster forwards there)
