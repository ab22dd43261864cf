"""Optional tool sets (desktop, browser) and the clear error when what they need is missing."""

from __future__ import annotations

import importlib.util

from tether.errors import ToolAreaError


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
