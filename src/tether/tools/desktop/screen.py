"""Screen capture: the whole screen, a region or the active window, as PNG (base64 or a file).

Grabbing (`mss`) and PNG encoding (`Pillow`) are blocking C calls of a few to tens of milliseconds,
so they run in a worker thread. A new `mss` instance is opened per grab in that thread: its X
connection is not safe to share between threads, and opening one costs about a millisecond.
A region is clipped to the screen (X refuses to read outside it) and the result says what was
really captured; `scale` shrinks (or enlarges) the image after the grab, and both sizes are reported.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from tether.tools.context import ToolContext
from tether.tools.errors import PolicyDenied, ToolError
from tether.tools.policy.jail import real, resolve_path, within
from tether.tools.runtime import ToolFunction, tool

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

    from tether.tools.desktop.x11 import X11

# Pillow's default. A lower level encodes faster but makes files notably bigger, and these bytes travel
# to the server as base64.
PNG_COMPRESS_LEVEL = 6


class Region(BaseModel):
    """A rectangle in screen pixels; (x, y) is its top-left corner."""

    model_config = ConfigDict(extra="forbid")

    x: int
    y: int
    width: Annotated[int, Field(gt=0)]
    height: Annotated[int, Field(gt=0)]


@dataclass(frozen=True, slots=True)
class Capture:
    """Raw BGRA pixels of one grab and where on the screen they came from."""

    x: int
    y: int
    width: int
    height: int
    bgra: bytes

    @property
    def region(self) -> dict[str, int]:
        return {"x": self.x, "y": self.y, "width": self.width, "height": self.height}

    def image(self) -> Image.Image:
        from PIL import Image

        return Image.frombytes("RGB", (self.width, self.height), self.bgra, "raw", "BGRX")

    def bgr(self) -> np.ndarray:
        """Contiguous BGR pixels: what OpenCV-based OCR expects, without a colour conversion."""
        import numpy as np

        return np.ascontiguousarray(np.frombuffer(self.bgra, np.uint8).reshape(self.height, self.width, 4)[:, :, :3])


def clip(region: dict[str, int], screen: tuple[int, int]) -> dict[str, int]:
    """`region` cut to the screen; a ToolError when nothing of it is on screen."""
    x0, y0 = max(region["x"], 0), max(region["y"], 0)
    x1 = min(region["x"] + region["width"], screen[0])
    y1 = min(region["y"] + region["height"], screen[1])
    if x1 <= x0 or y1 <= y0:
        raise ToolError(f"region {region} lies outside the {screen[0]}x{screen[1]} screen")
    return {"x": x0, "y": y0, "width": x1 - x0, "height": y1 - y0}


def grab_sync(display: str, region: dict[str, int] | None) -> Capture:
    """One grab on `display` (the whole screen when `region` is None); call it in a worker thread."""
    import mss

    factory = getattr(mss, "MSS", None) or mss.mss  # mss >= 10.2 renamed the factory
    try:
        with factory(display=display) as sct:
            if region is None:
                mon = sct.monitors[0]
                area = {"left": mon["left"], "top": mon["top"], "width": mon["width"], "height": mon["height"]}
            else:
                area = {"left": region["x"], "top": region["y"], "width": region["width"],
                        "height": region["height"]}
            shot = sct.grab(area)
    except mss.exception.ScreenShotError as exc:
        raise ToolError(f"screen capture on {display!r} failed: {exc}") from None
    return Capture(x=area["left"], y=area["top"], width=shot.width, height=shot.height, bgra=bytes(shot.bgra))


async def grab(x11: X11 | Any, region: dict[str, int] | None = None) -> Capture:
    """Grab the screen or a region of it (clipped to the screen) without blocking the event loop: with
    mss on an X display, or with the display's own `grab_sync` (sway: grim)."""
    if region is not None:
        region = clip(region, await x11.screen_size())
    own = getattr(x11, "grab_sync", None)
    if own is not None:
        return await asyncio.to_thread(own, region)
    return await asyncio.to_thread(grab_sync, x11.display, region)


def encode_png(capture: Capture, scale: float) -> tuple[bytes, int, int]:
    """PNG bytes of the capture resized by `scale`, and the output size."""
    from PIL import Image

    img = capture.image()
    if scale != 1.0:
        size = (max(1, round(capture.width * scale)), max(1, round(capture.height * scale)))
        img = img.resize(size, Image.Resampling.LANCZOS if scale < 1 else Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue(), img.width, img.height


def _write_new(ctx: ToolContext, path: str, data: bytes) -> Path:
    """Write `data` to a new file inside the write roots (never over an existing one), journaled so
    an undo removes it. Refusing to overwrite keeps a data-collection tool from destroying files."""
    target = resolve_path(ctx.policy, path, write=True, hidden=ctx.secrets)
    if ctx.journal is not None and within(target, [real(ctx.journal.root)]):
        raise PolicyDenied("journal", f"{path!r} lies inside the undo journal ({ctx.journal.root})")
    if os.path.lexists(target):
        raise ToolError(f"already exists: {path} (screenshots are only written to new files)")
    if not target.parent.is_dir():
        raise ToolError(f"parent directory does not exist: {target.parent}")
    if ctx.journal is not None:
        try:
            ctx.journal.record(ctx.session_id or "default", "write", target)
        except (OSError, ValueError) as exc:
            raise ToolError(f"could not journal {target} before writing it ({exc}); nothing was written") from exc
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except FileExistsError:
        raise ToolError(f"already exists: {path}") from None
    with open(fd, "wb") as fh:
        fh.write(data)
    return target


def screenshot_tool(x11: X11 | Any, remember: Callable[[Capture], str] | None = None) -> ToolFunction:
    """The `screenshot` tool bound to one display; with `remember` (a `FrameStore.add`), every screenshot
    is remembered and its answer carries the frame id that actions may name."""

    @tool(tool_type="data_collection")
    async def screenshot(ctx: ToolContext, region: Region | None = None, activeWindow: bool = False,
                         path: str | None = None,
                         scale: Annotated[float, Field(gt=0, le=4)] = 1.0,
                         keepFrame: bool = True) -> dict[str, Any]:
        """Capture the screen, a region of it or the active window as PNG: base64 `data`, or written to
        a new file at `path` (inside the allowed roots). Sizes before and after `scale` are reported;
        `frame` names this picture for actions (`click(..., frame=...)` is refused if the screen changed).
        `keepFrame=False` keeps no frame (a live view's pictures must not push an agent's frames out)."""
        if region is not None and activeWindow:
            raise ToolError("give either 'region' or 'activeWindow', not both")
        screen = await x11.screen_size()
        window = None
        area: dict[str, int] | None = None
        if activeWindow:
            window = await x11.active_window()
            if window is None:
                raise ToolError("no active window (nothing has the keyboard focus); capture the screen instead")
            area = window.region
        elif region is not None:
            area = region.model_dump()
        capture = await grab(x11, area)
        data, width, height = await asyncio.to_thread(encode_png, capture, scale)
        result: dict[str, Any] = {
            "width": width, "height": height, "scale": scale, "format": "png", "bytes": len(data),
            "captured": capture.region, "screen": {"width": screen[0], "height": screen[1]},
        }
        if window is not None:
            result["window"] = window.as_dict()
        if remember is not None and keepFrame:
            result["frame"] = remember(capture)
        if path is None:
            result["data"] = base64.b64encode(data).decode("ascii")
        else:
            result["path"] = str(await asyncio.to_thread(_write_new, ctx, path, data))
        return result

    return screenshot
