"""The built-in tool sets a device can load by name (`server_type: local`, `toolset: NAME`).

`desktop` and `browser` are optional: their factories raise `MissingDependency` (saying what to
install) when their packages, programs or display are missing, and the device then simply does
not list their tools.
"""

from __future__ import annotations

from collections.abc import Callable

from tether.tools.runtime import ToolSet

OPTIONAL_SETS = ("desktop", "browser")

# what each optional set offers, so a call to one of its tools on a device without it can say
# what to install instead of "unknown tool"
OPTIONAL_TOOLS: dict[str, tuple[str, ...]] = {
    "browser": ("browser.act",),
    "desktop": ("screenshot", "get_ui_tree", "click_element", "click", "press_key", "scroll", "type_text",
                "ui.findAndClick", "ui.typeText", "ui.waitFor"),
}


def _desktop() -> ToolSet:
    from tether.tools.optional import MissingDependency

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
    from tether.tools.optional import MissingDependency

    try:
        from tether.tools.browser.tool import browser_toolset
    except ImportError as exc:
        raise MissingDependency(f"the browser tools need their extra: pip install 'tether[browser]' ({exc})") from exc
    return browser_toolset()


def builtin_toolsets() -> dict[str, Callable[[], ToolSet]]:
    """A fresh name → factory mapping; a new dict each call so nobody can mutate a shared registry."""
    from tether.tools.files.tool import files_toolset
    from tether.tools.files.transfer_tools import transfer_toolset
    from tether.tools.shell.tool import shell_toolset
    from tether.tools.system.tool import system_toolset

    return {"shell": shell_toolset, "files": files_toolset, "system": system_toolset, "transfer": transfer_toolset,
            "desktop": _desktop, "browser": _browser}
