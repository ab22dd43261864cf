"""frames.difference as a table: what counts as a changed screen (pure; no display needed)."""

from __future__ import annotations

import numpy as np

from tether.tools.desktop.frames import FrameStore, crop, difference
from tether.tools.desktop.screen import Capture


def capture(px: np.ndarray, x: int = 100, y: int = 50) -> Capture:
    return Capture(x, y, px.shape[1], px.shape[0], np.ascontiguousarray(px).tobytes())


def test_what_makes_a_frame_stale() -> None:
    base = np.full((60, 80, 4), 255, np.uint8)
    assert difference(capture(base), capture(base.copy())) is None

    noise = base.copy()
    noise[10:20, 10:30, :3] -= 20  # antialiasing-sized shifts are not changes
    assert difference(capture(base), capture(noise)) is None

    caret = base.copy()
    caret[5:40, 33:35, :3] = 0  # a 2-pixel-wide caret blinking on
    assert difference(capture(base), capture(caret)) is None

    button = caret.copy()
    button[20:30, 40:70, :3] = 0  # a caret and a new 30x10 block: stale, the box covers both
    change = difference(capture(base), capture(button))
    assert change is not None and change.box == {"x": 133, "y": 55, "width": 37, "height": 35}
    assert change.pixels == 35 * 2 + 300 and change.contains(150, 80) and not change.contains(100, 50)

    moved = difference(capture(base), capture(base, x=101))
    assert moved is not None and moved.fraction == 1.0


def test_crop_and_the_store_keeps_the_last_frames() -> None:
    px = np.arange(60 * 80 * 4, dtype=np.uint32).astype(np.uint8).reshape(60, 80, 4)
    part = crop(capture(px), {"x": 95, "y": 55, "width": 10, "height": 10}, margin=2)
    assert (part.x, part.y, part.width, part.height) == (100, 53, 7, 14)  # clipped at the capture's left edge
    assert part.bgra == np.ascontiguousarray(px[3:17, 0:7]).tobytes()
    store = FrameStore(keep=2)
    ids = [store.add(capture(px)) for _ in range(3)]
    assert ids == ["f1", "f2", "f3"] and store.get("f1") is None and store.ids() == ["f2", "f3"]
