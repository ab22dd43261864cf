"""Key tokens for `browser.act`: `{ENTER}`, `{CMD+K}` and the like in seed 004's spelling, as Playwright names them.

Agents write keys the way the seed does; Playwright wants its own names. The translation, and the
rule for telling a token from text that merely has braces in it (code, JSON), is easy to get subtly
wrong and needs no browser, so it is kept here on its own.
"""

from __future__ import annotations

import re

from tether.tools.errors import ToolError

_KEYS = {"ENTER": "Enter", "RETURN": "Enter", "TAB": "Tab", "ESC": "Escape", "ESCAPE": "Escape",
         "BACKSPACE": "Backspace", "DELETE": "Delete", "DEL": "Delete", "UP": "ArrowUp", "DOWN": "ArrowDown",
         "LEFT": "ArrowLeft", "RIGHT": "ArrowRight", "HOME": "Home", "END": "End", "PAGEUP": "PageUp",
         "PAGEDOWN": "PageDown", "SPACE": "Space", "INSERT": "Insert"} | {f"F{i}": f"F{i}" for i in range(1, 13)}
_MODIFIERS = {"CMD": "Meta", "COMMAND": "Meta", "META": "Meta", "SUPER": "Meta", "WIN": "Meta", "CTRL": "Control",
              "CONTROL": "Control", "ALT": "Alt", "OPTION": "Alt", "SHIFT": "Shift"}
_TOKEN = re.compile(r"\{([A-Z][A-Z0-9]*(?:\+[A-Z0-9]+)*)\}")


def key_for_token(token: str) -> str:
    """Playwright's name for `ENTER`, `CMD+K`, `CTRL+SHIFT+TAB`... (CMD is Meta, CTRL is Control)."""
    parts = token.upper().split("+")
    *mods, last = parts
    if any(m not in _MODIFIERS for m in mods):
        bad = next(m for m in mods if m not in _MODIFIERS)
        raise ToolError(f"unknown modifier {bad!r} in {{{token}}}; modifiers: {', '.join(sorted(_MODIFIERS))}")
    if last in _KEYS:
        key = _KEYS[last]
    elif last in _MODIFIERS:
        key = _MODIFIERS[last]
    elif mods and len(last) == 1:
        key = last.lower()
    else:
        raise ToolError(f"unknown key token {{{token}}}; keys: {', '.join(sorted(_KEYS))}, combos like {{CMD+K}}")
    return "+".join([*(_MODIFIERS[m] for m in mods), key])


def split_keys(text: str) -> list[tuple[bool, str]]:
    """`text` as (is_key, value) steps: literal chunks to type and key presses for `{ENTER}`, `{CMD+K}`...

    Only upper-case words in braces are tokens, so `{"a": 1}` or `{x}` in code are typed as written;
    an unknown upper-case token (`{ENTR}`) is an error rather than silently typed text.
    """
    steps: list[tuple[bool, str]] = []
    pos = 0
    for match in _TOKEN.finditer(text):
        if match.start() > pos:
            steps.append((False, text[pos:match.start()]))
        steps.append((True, key_for_token(match.group(1))))
        pos = match.end()
    if pos < len(text):
        steps.append((False, text[pos:]))
    return steps


def key_name(key: str) -> str:
    """A `press` key: a token (`{ENTER}`, `CMD+K`) in seed 004's spelling, else Playwright's name as given."""
    inner = key[1:-1] if key.startswith("{") and key.endswith("}") else key
    *mods, last = inner.split("+")
    if _TOKEN.fullmatch("{" + inner + "}") and all(m in _MODIFIERS for m in mods) and (
            last in _KEYS or last in _MODIFIERS or (mods and len(last) == 1)):
        return key_for_token(inner)
    return key
