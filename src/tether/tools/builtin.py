"""The built-in tool sets a device can load by name (`server_type: local`, `toolset: NAME`)."""

from __future__ import annotations

from collections.abc import Callable

from tether.tools.runtime import ToolSet


def builtin_toolsets() -> dict[str, Callable[[], ToolSet]]:
    """A fresh name → factory mapping; a new dict each call so nobody can mutate a shared registry."""
    from tether.tools.files import files_toolset
    from tether.tools.shell import shell_toolset
    from tether.tools.system import system_toolset

    return {"shell": shell_toolset, "files": files_toolset, "system": system_toolset}
