"""Text from elsewhere shown so that it cannot drive the terminal it is shown in.

Device names, pairing requests (sent without any credential), task requests and plans, tool names,
audit rows, a command's output: all of it comes from a device, a requester or a model, and printed as
it is, an ESC sequence in it rewrites the terminal (moves the cursor, hides lines, sets the window
title, on some terminals worse), a `\\r` overwrites what the line said, and a bidi override
(U+202E) shows `exe.txt` for `txt.exe`.

`visible(text)` renders every such character visibly: the C0 controls (but `\\n` and `\\t`, which
text keeps), DEL, the C1 controls, the line and paragraph separators, and the bidi embeddings,
overrides, isolates and marks — as `\\x1b`, `\\r`, `\\u202e`. `SafeConsole` is the rich `Console`
every CLI view prints through (`console()`): whatever string reaches it, as markup, as a
table cell or as a `Text`, leaves through `visible`, so no view can forget it. Rich markup in
foreign strings is escaped where they are put into markup (`rich.markup.escape`), as before.

`tether exec --raw` writes a command's output bytes as they are, for those who want them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment
from rich.text import Text

from tether.printable import CONTROL_BUT_LINES, printable


def visible(value: object, *, one_line: bool = False) -> str:
    """`value` as text with every terminal control character shown as an escape (`\\x1b`, `\\u202e`);
    `\\n` and `\\t` are kept unless `one_line`."""
    return printable(value, keep_lines=not one_line)


class SafeConsole(Console):
    """A rich `Console` that shows terminal control characters in what it prints as escapes (`visible`).

    Strings are escaped as they become `Text` (`render_str`: before layout, so tables measure what is
    shown); anything else — a `Text` made elsewhere, a renderable's own segments — as its segments
    leave (`render`). Rich's own control segments (cursor moves of a live display) pass."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(visible(text), **kwargs)

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterable[Segment]:
        for segment in super().render(renderable, options):
            if segment.control is None and CONTROL_BUT_LINES.search(segment.text) is not None:
                yield Segment(visible(segment.text), segment.style)
            else:
                yield segment


def console(err: bool = False) -> Console:
    """The console every view prints through (stdout, or stderr when `err`): terminal control characters in
    what it prints are shown as escapes (`SafeConsole`), whoever supplied the text."""
    return SafeConsole(stderr=err, highlight=False)


def say(text: str, style: str = "", err: bool = False, **kwargs: Any) -> None:
    """Print text that is not ours (a tool's error, a server's message, a person's request) as it is:
    its `[...]` is never read as rich markup. The leading `error:` / `warning:` word is coloured, and such a
    line is never folded at the terminal's width (`soft_wrap`), so a path or URL in it stays whole to copy;
    `style` styles the whole line, `kwargs` go to `Console.print`."""
    head, sep, rest = text.partition(" ")
    colour = {"error:": "red", "warning:": "yellow"}.get(head)
    if colour:
        kwargs.setdefault("soft_wrap", True)
    line = Text.assemble((head, colour), sep, rest) if colour else Text(text)
    if style:
        line.stylize(style)
    console(err=err).print(line, **kwargs)
