"""YAML read as YAML 1.2 reads booleans: only `true`/`false` (any case) are booleans.

PyYAML follows YAML 1.1, where `on`, `off`, `yes`, `no`, `y` and `n` are booleans too: a plan's
fan-out step `on: all` becomes `{True: 'all'}` and a policy's `ask: no` the boolean False. Every
plan, policy and config file tether reads goes through `safe_load` here, so what is written is what
is read. Imports only PyYAML (lazily) and nothing of tether, so any layer may use it.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

__all__ = ["safe_load"]

_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


@cache
def _loader() -> type:
    """A SafeLoader subclass whose bool resolver accepts only true/false (built once, then reused)."""
    import yaml

    class Yaml12Loader(yaml.SafeLoader):
        """SafeLoader with YAML 1.2 booleans."""

    resolvers = {first: [(tag, regexp) for tag, regexp in entries if tag != "tag:yaml.org,2002:bool"]
                 for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Yaml12Loader.yaml_implicit_resolvers = resolvers
    Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL, list("tTfF"))
    return Yaml12Loader


def safe_load(text: str | bytes) -> Any:
    """Parse one YAML document (text, or bytes in UTF-8/16) like `yaml.safe_load`, except that only
    true/false are booleans (`on`, `off`, `yes`, `no`, `y`, `n` stay strings). Raises `yaml.YAMLError`
    on invalid YAML."""
    import yaml

    return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
