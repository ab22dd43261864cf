"""The states of a graph plan's steps (saved in `Task.step_states`) and the names the graph's parts share."""

from __future__ import annotations

from collections.abc import Callable

from tether.agent.planning.edits import GONE, REMOVED, REPLACED
from tether.protocol.profile import DeviceRequirements

PENDING, RUNNING, DONE, FAILED, SKIPPED = "pending", "running", "done", "failed", "skipped"
ENDED = frozenset({DONE, FAILED, SKIPPED, REPLACED, REMOVED})
RESTART_UNKNOWN = "restart_unknown"  # a step in flight whose outcome the restarted server could not learn

Chooser = Callable[[DeviceRequirements], tuple[str, str]]

__all__ = ["DONE", "ENDED", "FAILED", "GONE", "PENDING", "REMOVED", "REPLACED", "RESTART_UNKNOWN", "RUNNING",
           "SKIPPED", "Chooser"]
