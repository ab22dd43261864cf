"""Untrusted text made printable: every terminal control character shown as an escape.

Device names, pairing requests, plans and command output come from the other end of a socket. Shown
as they are, an ESC sequence rewrites the terminal, a `\\n` forges a log line, and a bidi override
(U+202E) shows "exe.txt" for "txt.exe". `printable` escapes C0, DEL, C1, the Unicode line and
paragraph separators and the bidi marks, embeddings, overrides and isolates. The server's log filter
(`tether.server.http.logsafe`) and the CLI's console (`tether.cli.views.safe_text`) both use it. Standard library
only, importing nothing of tether, so any layer may use it.
"""

from __future__ import annotations

import re

# C0, DEL, C1, the line and paragraph separators, and the bidi marks, embeddings, overrides and isolates
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
# the same, but newline and tab are kept (a body of output that spans lines)
CONTROL_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: object, *, keep_lines: bool = False) -> str:
    """`value` as text with every control character escaped (`\\n`, `\\r`, `\\t`, `\\x1b`, `\\u202e`…);
    with `keep_lines`, newline and tab stay as they are. Text with nothing to escape is returned as is."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():  # every character CONTROL names is one Python counts as not printable (Cc, Cf, Zl, Zp)
        return text
    pattern = CONTROL_BUT_LINES if keep_lines else CONTROL
    if pattern.search(text) is None:
        return text
    return pattern.sub(_escape, text)


__all__ = ["CONTROL", "CONTROL_BUT_LINES", "printable"]
