"""Key names and the `ui.typeText` token language, as pure functions (tested as tables).

`ui.typeText` text is literal except for `{TOKEN}`s: a key (`{ENTER}`, `{TAB}`, `{F5}`) or a
combination (`{CTRL+C}`, `{CMD+SHIFT+T}`); `{{` and `}}` are literal braces. Tokens are checked
against a fixed list before anything is typed, so a typo fails the whole call instead of half
typing it. CMD / SUPER / WIN map to the Super key (Linux has no Command key).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from tether.errors import ToolAreaError

Button = Literal["left", "right", "middle", "double"]
MODIFIERS: dict[str, str] = {
    "CTRL": "ctrl", "CONTROL": "ctrl", "CMD": "super", "COMMAND": "super", "SUPER": "super", "WIN": "super",
    "META": "super", "ALT": "alt", "OPTION": "alt", "SHIFT": "shift",
}
KEYS: dict[str, str] = {
    "ENTER": "Return", "RETURN": "Return", "TAB": "Tab", "ESC": "Escape", "ESCAPE": "Escape",
    "BACKSPACE": "BackSpace", "BKSP": "BackSpace", "DELETE": "Delete", "DEL": "Delete", "INSERT": "Insert",
    "UP": "Up", "DOWN": "Down", "LEFT": "Left", "RIGHT": "Right", "HOME": "Home", "END": "End",
    "PGUP": "Page_Up", "PAGEUP": "Page_Up", "PGDN": "Page_Down", "PAGEDOWN": "Page_Down", "SPACE": "space",
    "MENU": "Menu", "PRINTSCREEN": "Print", "PLUS": "plus", **{f"F{i}": f"F{i}" for i in range(1, 25)},
}
# Characters that are allowed after modifiers ({CTRL+/}) and their X keysym names.
PUNCTUATION: dict[str, str] = {
    "/": "slash", "\\": "backslash", ",": "comma", ".": "period", "-": "minus", "=": "equal", ";": "semicolon",
    "'": "apostrophe", "`": "grave", "[": "bracketleft", "]": "bracketright",
}


class Segment(NamedTuple):
    """Literal text to type, or one xdotool key combination to press."""

    kind: Literal["text", "key"]
    value: str


class TokenError(ToolAreaError, ValueError):
    """A `{...}` token that is not a known key; the message names it and its position."""


def _key_name(name: str) -> str | None:
    upper = name.upper()
    if upper in KEYS:
        return KEYS[upper]
    if len(name) == 1 and name.isalnum():
        return name.lower()  # "ctrl+C" would press Shift too: combinations use the lower-case key
    return PUNCTUATION.get(name)


def token_to_combo(token: str) -> str:
    """`CTRL+SHIFT+T` → `ctrl+shift+t`; a TokenError for anything not in the tables."""
    parts = token.split("+")
    if token.endswith("++"):  # {CTRL++}: the plus key itself
        parts = [*token[:-2].split("+"), "PLUS"]
    if any(not p.strip() for p in parts):
        raise TokenError(f"empty key name in {{{token}}}")
    parts = [p.strip() for p in parts]
    mods, last = parts[:-1], parts[-1]
    combo = []
    for mod in mods:
        if mod.upper() not in MODIFIERS:
            raise TokenError(f"{mod!r} in {{{token}}} is not a modifier (use CTRL, ALT, SHIFT, CMD/SUPER/WIN)")
        combo.append(MODIFIERS[mod.upper()])
    if last.upper() in MODIFIERS:
        combo.append(MODIFIERS[last.upper()])
    else:
        key = _key_name(last)
        if key is None:
            known = ", ".join(k for k in KEYS if not (k[0] == "F" and k[1:].isdigit()))
            raise TokenError(f"unknown key {last!r} in {{{token}}}; known keys: {known}, F1-F24, single letters, "
                             "digits and / \\ , . - = ; ' ` [ ]")
        combo.append(key)
    return "+".join(combo)


def parse_typed_text(text: str) -> list[Segment]:
    """Split `ui.typeText` text into literal runs and key presses (adjacent runs merged)."""
    segments: list[Segment] = []
    literal: list[str] = []

    def flush() -> None:
        if literal:
            segments.append(Segment("text", "".join(literal)))
            literal.clear()

    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "{" and text.startswith("{{", i):
            literal.append("{")
            i += 2
        elif ch == "}" and text.startswith("}}", i):
            literal.append("}")
            i += 2
        elif ch == "}":
            raise TokenError(f"a lone '}}' at position {i}: write '}}}}' for a literal brace")
        elif ch == "{":
            end = text.find("}", i + 1)
            if end == -1:
                raise TokenError(f"'{{' at position {i} is never closed: write '{{{{' for a literal brace")
            token = text[i + 1:end]
            try:
                combo = token_to_combo(token)
            except TokenError as exc:
                raise TokenError(f"{exc} (at position {i}; write '{{{{' for a literal brace)") from None
            flush()
            segments.append(Segment("key", combo))
            i = end + 1
        else:
            literal.append(ch)
            i += 1
    flush()
    return segments


def normalize_key(key: str) -> str:
    """A `press_key` argument (`Enter`, `ctrl+c`, `Cmd+K`, `Page_Down`) as an xdotool key combination.

    Known names are mapped as in `ui.typeText`; anything else is passed through as an X keysym name
    (case matters there: `BackSpace`), and xdotool's "no such key" is reported as an error.
    """
    key = key.strip()
    if not key:
        raise TokenError("key is empty")
    if key == "+":
        return "plus"
    parts = [p.strip() for p in key.split("+")]
    if any(not p for p in parts):
        raise TokenError(f"empty key name in {key!r}")
    out = []
    for i, part in enumerate(parts):
        upper = part.upper()
        if upper in MODIFIERS:
            out.append(MODIFIERS[upper])
        elif i < len(parts) - 1:
            raise TokenError(f"{part!r} in {key!r} is not a modifier (use ctrl, alt, shift, cmd/super/win)")
        else:
            out.append(_key_name(part) or part)
    return "+".join(out)
