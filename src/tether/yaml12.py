"""YAML read as YAML 1.2 reads booleans: only `true`/`false` (any case) are booleans.

PyYAML follows YAML 1.1, where `on`, `off`, `yes`, `no`, `y` and `n` are booleans too: a plan's
fan-out step `on: all` becomes `{True: 'all'}` and a policy's `ask: no` the boolean False. Every
plan, policy and config file tether reads goes through `safe_load` here, so what is written is what
is read; and every YAML error about a file is told as `where_and_why` says it: line, column and the kind of
problem, never a line of the file (the file may be anyone's: `tether policy set --file /etc/shadow` as root).
Imports only PyYAML (lazily) and nothing of tether, so any layer may use it.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

__all__ = ["safe_load", "shown_key", "where_and_why"]

_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
# a quoted part of PyYAML's problem text: a token's name (`'<block end>'`), one character (`'\t'`), or what the
# file holds (a tag, an alias, an anchor, a tag handle), which is never shown
_QUOTED = re.compile(r"""'([^']*)'|"([^"]*)\"""")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,39}")
_SHOWN = re.compile(r"<[\w ]+>|.|\\(?:[a-z0-9]|x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})|#x[0-9a-f]{2,8}")


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


def where_and_why(exc: Exception) -> str:
    """A YAML error (`yaml.YAMLError` from `safe_load`, or the `UnicodeDecodeError` of reading the file; any
    other exception is told by its type only) in words that name the place and the kind of problem, never
    the text there: `line 3, column 7: mapping values are not allowed here`. Quoted parts of PyYAML's
    message that come from the file (a tag, an alias, an anchor) are left out; a token's name or one
    character stays (`found character '\\t' that cannot start any token`)."""
    import yaml

    if isinstance(exc, UnicodeDecodeError):  # a file read as UTF-8 before it was parsed
        return f"byte {exc.start + 1}: not valid {exc.encoding.upper()}"
    if isinstance(exc, yaml.reader.ReaderError):
        what = "a control character YAML does not allow" if exc.encoding == "unicode" else \
            f"bytes that are not valid {exc.encoding}"
        return f"character {exc.position + 1}: {what}"
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        told = ", ".join(filter(None, (exc.context, exc.problem))) or "not valid YAML"
        problem = _QUOTED.sub(_quoted, told)
        return problem if mark is None else f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return "not valid YAML" if isinstance(exc, yaml.YAMLError) else type(exc).__name__


def shown_key(key: object) -> str:
    """A key of a file's mapping as an error may show it: a name (letters, digits, `_`, `-`; up to 40) or a
    number as it is, anything else as `(a key that is no name)`: a file that is not a settings file at all
    (`/etc/shadow` read as YAML is a mapping of its lines) is never quoted back through its keys."""
    if isinstance(key, bool) or not isinstance(key, str | int):
        return "(a key that is no name)"
    return str(key) if isinstance(key, int) or _NAME.fullmatch(key) else "(a key that is no name)"


def _quoted(found: re.Match[str]) -> str:
    inner = found.group(1) if found.group(1) is not None else found.group(2)
    return found.group(0) if _SHOWN.fullmatch(inner) else "(not shown)"
