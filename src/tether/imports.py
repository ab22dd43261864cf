"""Lazy module-level names (PEP 562) for tether's public facades.

A facade lists its names and the module each comes from; a name's module is imported the first time
the name is read, so importing the facade itself imports nothing heavy. websockets' `imports.py` is
the model.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_import"]


def lazy_import(namespace: dict[str, Any], aliases: Mapping[str, str]) -> tuple[Callable[[str], Any],
                                                                              Callable[[], Iterable[str]]]:
    """Return `__getattr__` and `__dir__` for the module whose globals are `namespace`.

    `aliases` maps each lazy name to the absolute module that defines it. Reading `module.NAME` imports
    that module and returns its attribute (the module caches nothing itself: Python's module cache
    makes later reads cheap). An unknown name raises `AttributeError` as a normal module does.
    `AssertionError` when a lazy name is also defined in `namespace` (one of the two would be hidden).
    """
    package = namespace["__name__"]
    assert not set(namespace) & set(aliases), "a lazy name is also defined in the module"

    def __getattr__(name: str) -> Any:
        try:
            source = aliases[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        return getattr(importlib.import_module(source), name)

    def __dir__() -> Iterable[str]:
        return sorted(set(namespace) | set(aliases))

    return __getattr__, __dir__
