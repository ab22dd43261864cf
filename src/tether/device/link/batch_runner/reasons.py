"""The batch runner's numbers and failure wordings: the default number of sessions run at once, and what a command
left without a result is told when the server cancels its batch or the device shuts down."""

from __future__ import annotations

CANCELLED_BY_SERVER = "cancelled by the server"
DEFAULT_MAX_CONCURRENT_SESSIONS = 4
SHUTTING_DOWN = "not run: the device is shutting down"
# the command that was running when the device stopped: it may have done some or all of its work
SHUTDOWN_WHILE_RUNNING = ("outcome unknown: the command was running when the device shut down and was stopped; "
                          "it may have made some or all of its changes")
