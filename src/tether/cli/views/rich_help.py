"""typer's help and error panels without rich's Markdown and traceback modules, so `tether --help` starts fast.

typer 0.29's `typer.rich_utils`, which draws every help screen and usage error, imports `rich.markdown`
(markdown-it and pygments) and `rich.traceback` at its top: for help written in Markdown
(`rich_markup_mode="markdown"`) and for pretty tracebacks. tether's help is rich markup and its errors are one
line, so printing help needs neither. typer has no switch for this: `TYPER_USE_RICH=0` or
`rich_markup_mode=None` drop the panels themselves.

`load_rich_utils()` imports `typer.rich_utils` with a stand-in for each of those two names: a class that
imports the real one the first time it is used (an instance made, a class attribute read, such as
`Traceback.from_exception`), so typer behaves as before if it ever needs them. The stand-in modules are in
`sys.modules` only while `typer.rich_utils` is imported: a later `import rich.markdown` gets the real one.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

DEFERRED = (("rich.markdown", "Markdown"), ("rich.traceback", "Traceback"))


def load_rich_utils() -> None:
    """Import `typer.rich_utils` without `rich.markdown` and `rich.traceback` (a no-op once it is imported)."""
    if "typer.rich_utils" in sys.modules:
        return
    placed: dict[str, types.ModuleType] = {}
    for module, name in DEFERRED:
        if module not in sys.modules:
            stand_in = types.ModuleType(module, f"stands in for {module} while typer.rich_utils is imported")
            setattr(stand_in, name, _deferred(module, name))
            placed[module] = stand_in
    sys.modules.update(placed)
    try:
        importlib.import_module("typer.rich_utils")
    finally:
        for module, stand_in in placed.items():
            if sys.modules.get(module) is stand_in:
                del sys.modules[module]


class _Deferred(type):
    """The metaclass of a stand-in: an attribute the stand-in class lacks is read from the real class."""

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__"):  # typing's and inspect's probes (__origin__, …) must not import anything
            raise AttributeError(attr)
        return getattr(cls.real(), attr)


def _deferred(module: str, name: str) -> type:
    def real(cls: type) -> type:
        return getattr(importlib.import_module(module), name)

    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        return real(cls)(*args, **kwargs)  # an instance of the real class (so the stand-in's __init__ is skipped)

    return _Deferred(name, (), {"real": classmethod(real), "__new__": new, "__module__": module,
                                "__doc__": f"imports {module}.{name} when first used"})
