"""A status line while nothing else is printed: the LLM planning (with the count of tokens it has streamed)
or a long step running, each with its elapsed time, so the screen is never silent. Only on a terminal.

The line is redrawn in place (`\\r`, erase to the end of the line) by one asyncio task per view, started
when the first status is set from inside a running loop; anything else printed erases it first
(`erase`) and the next tick draws it again under the new output. Without a loop the line is drawn
at each event instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable
from typing import TextIO

from tether.cli.views.safe_text import visible

FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
TICK_S = 0.1  # redraw rate of the line (a display refresh, not a wait for anything)
WIDTH = 100


class Spinner:
    def __init__(self, stream: TextIO | None = None, *, clock: Callable[[], float] = time.monotonic,
                 enabled: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.clock = clock
        self.label: str | None = None
        self.started = 0.0
        self.tokens = 0
        self.frame = 0
        self.drawn = False
        self._ticker: asyncio.Task[None] | None = None

    def set(self, label: str) -> None:
        """Show `label` from now on (its clock starts now; the token count starts at 0)."""
        if not self.enabled:
            return
        self.label, self.started, self.tokens = label, self.clock(), 0
        self._ensure_ticker()
        self.draw()

    def count(self, tokens: int) -> None:
        if self.enabled and self.label is not None:
            self.tokens = tokens
            self.draw()

    def stop(self) -> None:
        self.erase()
        self.label = None

    def erase(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.drawn = False

    def text(self) -> str:
        elapsed = self.clock() - self.started
        tokens = f", {self.tokens} tokens" if self.tokens else ""
        label = visible(self.label, one_line=True)  # a step's tool name comes from a plan
        return f"{FRAMES[self.frame % len(FRAMES)]} {label} … {elapsed:.1f} s{tokens}"[:WIDTH]

    def draw(self) -> None:
        if not self.enabled or self.label is None:
            return
        self.stream.write("\r\x1b[K" + self.text())
        self.stream.flush()
        self.drawn = True

    def _ensure_ticker(self) -> None:
        if self._ticker is not None and not self._ticker.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # drawn at each event instead
        self._ticker = loop.create_task(self._tick(), name="status line")

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            if self.label is not None:
                self.frame += 1
                self.draw()

    async def aclose(self) -> None:
        self.stop()
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
