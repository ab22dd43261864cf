"""The built-in tool sets a device can load by name (`server_type: local`, `toolset: NAME`).

`desktop` and `browser` are optional: their factories raise `MissingDependency` (saying what to
install) when their packages, programs or display are missing, and the device then simply does
not list their tools.

Each factory imports its set's modules when it is called, and `BUILTIN_TOOLS` names every set's tools
without importing them, so a device that runs one command (a one-off `tether exec`) builds only the sets
that hold its tool (`Computer`'s `only_tool`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

from tether.tools.runtime import ToolSet

K = TypeVar("K", bound=Hashable)

OPTIONAL_SETS = ("desktop", "browser")

# what each optional set offers, so a call to one of its tools on a device without it can say
# what to install instead of "unknown tool"
OPTIONAL_TOOLS: dict[str, tuple[str, ...]] = {
    "browser": ("browser.act",),
    "desktop": ("screenshot", "get_ui_tree", "click_element", "click", "press_key", "scroll", "type_text",
                "ui.findAndClick", "ui.typeText", "ui.waitFor"),
}

# every built-in set's tool names, known without importing the set (tests/tools/test_builtin.py checks them
# against the sets themselves)
BUILTIN_TOOLS: dict[str, tuple[str, ...]] = {
    "shell": ("shell.run", "shell_execute", "shell_execute_read"),
    "files": ("delete_file", "file_info", "list_dir", "move_file", "read_file", "write_file"),
    "system": ("close_application", "get_system_info", "launch_application", "list_processes"),
    "transfer": ("read_file_chunk", "transfer_begin", "transfer_commit", "transfer_manifest", "write_file_chunk"),
    **OPTIONAL_TOOLS,
}


def _shell() -> ToolSet:
    from tether.tools.shell.tool import shell_toolset

    return shell_toolset()


def _files() -> ToolSet:
    from tether.tools.files.tool import files_toolset

    return files_toolset()


def _system() -> ToolSet:
    from tether.tools.system.tool import system_toolset

    return system_toolset()


def _transfer() -> ToolSet:
    from tether.tools.files.transfer_tools import transfer_toolset

    return transfer_toolset()


def _desktop() -> ToolSet:
    from tether.tools.errors import MissingDependency

    try:
        from tether.tools.desktop.x11 import desktop_problem

        problem = desktop_problem(probe=False)  # no display or extra: the tools' modules are never imported
        if problem:
            raise MissingDependency(problem)
        from tether.tools.desktop.tool import desktop_toolset
    except ImportError as exc:
        raise MissingDependency(f"the desktop tools need their extra: pip install 'tether[desktop]' ({exc})") from exc
    return desktop_toolset()


def _browser() -> ToolSet:
    from tether.tools.errors import MissingDependency

    try:
        from tether.tools.browser.tool import browser_toolset
    except ImportError as exc:
        raise MissingDependency(f"the browser tools need their extra: pip install 'tether[browser]' ({exc})") from exc
    return browser_toolset()


def builtin_toolsets() -> dict[str, Callable[[], ToolSet]]:
    """A fresh name → factory mapping; a new dict each call so nobody can mutate a shared registry. A factory
    imports its set's modules when called."""
    return {"shell": _shell, "files": _files, "system": _system, "transfer": _transfer, "desktop": _desktop,
            "browser": _browser}


def sets_not_holding(tool: str | None, sets: Iterable[tuple[K, str | None, str]]) -> set[K]:
    """Of a computer's servers `(key, toolset, namespace)` (toolset None for an external server), the keys of
    the built-in sets that cannot hold `tool` (by `BUILTIN_TOOLS`: its plain name, or `namespace/name`), which
    a computer asked for `tool` alone need not start. Those that can hold it all start, in their order, so
    the tool resolves to the same set, and a collision or a wrong type reads as with every set started;
    external servers and sets of unknown name are never in the answer. Empty (everything starts) when no
    built-in set is known to hold `tool` (a meta tool, an external server's tool, an unknown name) or `tool`
    is None."""
    if tool is None:
        return set()
    holders: set[K] = set()
    others: set[K] = set()
    for key, toolset, namespace in sets:
        names = BUILTIN_TOOLS.get(toolset) if toolset is not None else None
        if names is None:
            continue
        held = tool in names or any(f"{namespace}/{name}" == tool for name in names)
        (holders if held else others).add(key)
    return others - holders if holders else set()
