"""The tools area's errors: those a tool raises to fail its command with a clear message (they never
leave the router), and `MissingDependency`, what an optional tool set (desktop, browser) raises when
what it needs is missing (`require` checks for a module without importing it)."""

from __future__ import annotations

import importlib.util
from typing import Any

from tether.errors import ToolAreaError


class ToolError(ToolAreaError):
    """The tool ran and failed; `result` may still carry a payload (e.g. stderr and the exit code)."""

    def __init__(self, message: str, result: Any = None) -> None:
        super().__init__(message)
        self.result = result


class PolicyDenied(ToolError):
    """The policy refused the call; the message names the rule so a person can find and change it."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"denied by policy rule '{rule}': {message}", {"denied": True, "rule": rule})
        self.rule = rule


class NeedsApproval(ToolError):
    """The action is one a person must approve; the command can be re-sent with `approved_by` set."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(
            f"needs approval (policy rule '{rule}'): {message}; re-send the command with an approval",
            {"needs_approval": True, "rule": rule},
        )
        self.rule = rule


class MissingDependency(ToolAreaError, RuntimeError):
    """A tool set cannot run here; the message says exactly what to install or set up."""


def require(module: str, hint: str) -> None:
    """Raise `MissingDependency(hint)` unless `module` can be imported (without importing it)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise MissingDependency(f"{hint} (Python module '{module}' is not installed)")
