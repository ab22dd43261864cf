"""A command's streamed output shown as a terminal would have shown it.

Output arrives in chunks cut wherever the pipe was read: half a line, or a progress bar that redraws
itself with `\\r`. Printing each chunk as a line breaks both up (`downloading:` / `0%` / `25%`). Each
stream (stdout, stderr of each command) keeps the line being written; a line is printed when it is
complete, `\\r` moves back to its start so what follows overwrites it, as on a terminal.
"""

from __future__ import annotations

from collections.abc import Callable

_MAX_LINE = 10_000  # a line with no end in sight is printed in pieces of this size


class _Line:
    __slots__ = ("chars", "pos")

    def __init__(self) -> None:
        self.chars: list[str] = []
        self.pos = 0


class TerminalLines:
    """Joins chunks per stream into whole lines and hands each to `emit(stream, line)`."""

    def __init__(self, emit: Callable[[str, str], None]) -> None:
        self.emit = emit
        self._lines: dict[tuple[str, str], _Line] = {}

    def feed(self, source: str, stream: str, text: str) -> None:
        """Take a chunk of `stream` (e.g. stdout) of `source` (e.g. a command's call id)."""
        line = self._lines.setdefault((source, stream), _Line())
        for ch in text:
            if ch == "\n":
                self._emit(stream, line)
            elif ch == "\r":
                line.pos = 0
            else:
                if line.pos < len(line.chars):
                    line.chars[line.pos] = ch
                else:
                    line.chars.append(ch)
                line.pos += 1
                if len(line.chars) >= _MAX_LINE:
                    self._emit(stream, line)

    def flush(self, source: str | None = None) -> None:
        """Print the lines not yet ended (of `source`, or of every source): its command has finished."""
        for key in [k for k in self._lines if source is None or k[0] == source]:
            line = self._lines.pop(key)
            if line.chars:
                self.emit(key[1], "".join(line.chars))

    def _emit(self, stream: str, line: _Line) -> None:
        text = "".join(line.chars)
        line.chars.clear()
        line.pos = 0
        self.emit(stream, text)
