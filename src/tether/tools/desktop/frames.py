"""Frames: every screenshot (and every UI tree) gets a frame id, and an action that names the frame it
was based on is refused when the screen has changed since, so an agent never clicks on a stale picture.

A `FrameStore` keeps the pixels of the last KEEP frames (a full 1280x800 screen is 4 MB). Checking a
frame grabs the same region again and compares: a pixel counts as changed when a colour channel moved by
more than PIXEL_DELTA (antialiasing noise stays below), and a change no wider than CARET_WIDTH pixels
is a blinking text caret, not a new screen. Anything else is stale, described by its bounding box, how
many pixels changed, whether the action's point lies inside, and the text there before and after (OCR).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tether.tools.desktop.screen import Capture

KEEP = 8
PIXEL_DELTA = 24
CARET_WIDTH = 3


@dataclass(frozen=True, slots=True)
class Frame:
    """One remembered screen (or region of it)."""

    id: str
    capture: Capture
    taken_at: float


@dataclass(frozen=True, slots=True)
class Change:
    """How a region differs from a frame: the changed pixels' bounding box and count."""

    box: dict[str, int]
    pixels: int
    fraction: float

    def contains(self, x: int, y: int) -> bool:
        b = self.box
        return b["x"] <= x < b["x"] + b["width"] and b["y"] <= y < b["y"] + b["height"]


class FrameStore:
    """The last KEEP frames of one desktop, by id (`f1`, `f2`, ...)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._frames: OrderedDict[str, Frame] = OrderedDict()
        self._numbers = itertools.count(1)

    def add(self, capture: Capture) -> str:
        """Remember `capture` as a new frame and return its id (the oldest frame beyond KEEP is dropped)."""
        frame = Frame(f"f{next(self._numbers)}", capture, time.time())
        self._frames[frame.id] = frame
        while len(self._frames) > self.keep:
            self._frames.popitem(last=False)
        return frame.id

    def get(self, frame_id: str) -> Frame | None:
        return self._frames.get(frame_id)

    def ids(self) -> list[str]:
        return list(self._frames)


def difference(before: Capture, after: Capture) -> Change | None:
    """Where `after` differs from `before` (same region), or None when only a caret blinked or nothing moved."""
    import numpy as np

    if (before.x, before.y, before.width, before.height) != (after.x, after.y, after.width, after.height):
        return Change(after.region, after.width * after.height, 1.0)
    a = np.frombuffer(before.bgra, np.uint8).reshape(before.height, before.width, 4)[:, :, :3]
    b = np.frombuffer(after.bgra, np.uint8).reshape(after.height, after.width, 4)[:, :, :3]
    moved = np.abs(a.astype(np.int16) - b.astype(np.int16)).max(axis=2) > PIXEL_DELTA
    count = int(np.count_nonzero(moved))
    if count == 0:
        return None
    rows, cols = np.nonzero(moved.any(axis=1))[0], np.nonzero(moved.any(axis=0))[0]
    x0, x1, y0, y1 = int(cols[0]), int(cols[-1]), int(rows[0]), int(rows[-1])
    if x1 - x0 + 1 <= CARET_WIDTH:
        return None
    box = {"x": before.x + x0, "y": before.y + y0, "width": x1 - x0 + 1, "height": y1 - y0 + 1}
    return Change(box, count, count / moved.size)


def crop(capture: Capture, box: dict[str, int], margin: int = 6) -> Capture:
    """The part of `capture` inside `box` (screen pixels) grown by `margin`, clipped to the capture."""
    import numpy as np

    x0 = max(capture.x, box["x"] - margin)
    y0 = max(capture.y, box["y"] - margin)
    x1 = min(capture.x + capture.width, box["x"] + box["width"] + margin)
    y1 = min(capture.y + capture.height, box["y"] + box["height"] + margin)
    px = np.frombuffer(capture.bgra, np.uint8).reshape(capture.height, capture.width, 4)
    part = np.ascontiguousarray(px[y0 - capture.y:y1 - capture.y, x0 - capture.x:x1 - capture.x])
    return Capture(x0, y0, x1 - x0, y1 - y0, part.tobytes())


def describe(change: Change, frame: Frame, point: tuple[int, int] | None, before_text: str | None,
             after_text: str | None) -> tuple[str, dict[str, Any]]:
    """The refusal message and its structured details for a stale frame."""
    b = change.box
    where = f"{b['width']}x{b['height']} at ({b['x']}, {b['y']})"
    hit = ""
    if point is not None:
        hit = " — the action's point lies inside it" if change.contains(*point) else \
            " (the action's point is outside it)"
    texts = ""
    if before_text is not None or after_text is not None:
        texts = f"; text there before: {before_text or '(none)'!r}, now: {after_text or '(none)'!r}"
    age = time.time() - frame.taken_at
    message = (f"frame {frame.id} is stale: the screen changed since it was taken {age:.1f}s ago "
               f"({change.pixels} pixels, {change.fraction:.2%} of it, within {where}{hit}{texts}); "
               "take a new screenshot and act on what it shows")
    details = {"stale": True, "frame": frame.id, "changed": {"box": b, "pixels": change.pixels,
                                                            "fraction": round(change.fraction, 5)},
               "point_inside": change.contains(*point) if point is not None else None,
               "text_before": before_text, "text_after": after_text}
    return message, details
