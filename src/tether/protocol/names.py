"""Device names: one rule wherever a name is given (a pairing request, its approval, `tether token create`,
a rename), and one message when a name breaks it — in words, never the pattern."""

from __future__ import annotations

import re

DEVICE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$"
_NAME = re.compile(DEVICE_NAME)
RULE = "letters, digits, '.', '_', '@' and '-', starting with a letter or digit, at most 128 characters"


def suggest_device_name(name: str) -> str | None:
    """A name that keeps the rule and reads like `name` (spaces and other characters become '-'), or None."""
    fixed = re.sub(r"[^A-Za-z0-9._@-]+", "-", name.strip()).lstrip("._@-")[:128].rstrip("-")
    return fixed if fixed and _NAME.match(fixed) else None


def device_name_problem(name: str) -> str | None:
    """None for a good device name; else one sentence saying why not and what would do (for a 422 or a CLI
    error), e.g. "'my laptop' is not a device name: use letters, digits, … (e.g. 'my-laptop')"."""
    if _NAME.match(name):
        return None
    better = suggest_device_name(name)
    return f"{name[:140]!r} is not a device name: use {RULE}" + (f" (e.g. {better!r})" if better else "")
