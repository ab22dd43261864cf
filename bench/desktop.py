"""Time per `ui.findAndClick("Submit")` on a 1280x800 screen, split into screenshot / OCR / click.

    python -m bench.desktop [N]

Runs its own Xvfb (a free display chosen by Xvfb itself) and the Tk test program, so nothing on
a real display is touched. Anchor: a raw full-screen grab with mss in the same run — the floor any
screen-reading tool pays; the OCR pass is what dominates.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from bench._stats import summary
from tether.tools.context import ToolContext
from tether.tools.desktop.ocr import OcrEngine
from tether.tools.desktop.screen import grab_sync
from tether.tools.desktop.tool import desktop_toolset
from tether.tools.policy.model import Policy
from tether.tools.runtime import ToolSet

GUI_APP = Path(__file__).resolve().parent / "kit" / "gui_app.py"


def start_xvfb() -> tuple[subprocess.Popen[bytes], str]:
    read_fd, write_fd = os.pipe()
    argv = ["Xvfb", "-displayfd", str(write_fd), "-screen", "0", "1280x800x24", "-nolisten", "tcp", "-noreset"]
    proc = subprocess.Popen(argv, pass_fds=(write_fd,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write_fd)
    number = b""
    try:
        while not number.endswith(b"\n"):
            ready, _, _ = select.select([read_fd], [], [], 20)
            chunk = os.read(read_fd, 64) if ready else b""
            if not chunk:
                proc.kill()
                raise SystemExit("Xvfb did not start (apt-get install xvfb)")
            number += chunk
    finally:
        os.close(read_fd)
    return proc, f":{int(number)}"


def wait_for_line(log: Path, event: str, count: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and sum(json.loads(x)["event"] == event for x in log.read_text().splitlines()) >= count:
            return
        time.sleep(0.02)
    raise SystemExit(f"the test program never logged {count} x {event}")


async def main(n: int) -> None:
    xvfb, display = start_xvfb()
    with TemporaryDirectory() as tmp:
        log = Path(tmp) / "events.jsonl"
        app = subprocess.Popen([sys.executable, str(GUI_APP), str(log)], env={**os.environ, "DISPLAY": display})
        try:
            wait_for_line(log, "ready", 1)
            # the main figure: a fresh OCR pass every call (as after any change on screen)
            engine = OcrEngine(reuse_unchanged=False)
            t0 = time.perf_counter()
            engine.warm_up()
            load_s = time.perf_counter() - t0
            ctx = ToolContext(policy=Policy())
            fresh = desktop_toolset(display=display, ocr=engine)
            reusing = desktop_toolset(display=display, ocr=OcrEngine())  # the default: unchanged frames reuse
            for tools in (fresh, reusing):
                for _ in range(2):  # first passes size ONNX Runtime's buffers
                    assert (await tools.call("ui.findAndClick", {"label": "Submit"}, ctx)).ok

            raw = []
            for _ in range(n):
                t = time.perf_counter()
                grab_sync(display, None)
                raw.append(time.perf_counter() - t)
            runs = {name: await run(tools, ctx, n) for name, tools in (("fresh", fresh), ("reusing", reusing))}
            wait_for_line(log, "submit", 2 * n + 4)  # every click reached the program
        finally:
            app.terminate()
            app.wait(10)
            xvfb.terminate()
            xvfb.wait(10)

    print(f"ui.findAndClick('Submit') on a 1280x800 Xvfb with a Tk window, {n} calls "
          f"(OCR model load once: {load_s * 1e3:.0f} ms, {os.cpu_count()} CPUs)")
    anchor = summary("anchor: raw mss full-screen grab", raw)
    total, shot, ocr, click = runs["fresh"]
    row = summary("ui.findAndClick, fresh OCR each call", total)
    summary("  screenshot (grab in a worker thread)", shot)
    o = summary("  OCR (RapidOCR det + rec, 1280x800)", ocr)
    summary("  click (xdotool mousemove + click)", click)
    again = summary("ui.findAndClick, unchanged screen (OCR reused)", runs["reusing"][0])
    print(f"fresh: ratio to anchor p50 {row['p50_us'] / anchor['p50_us']:.0f}x, OCR is "
          f"{o['p50_us'] / row['p50_us']:.0%} of the p50; unchanged screen: "
          f"{again['p50_us'] / anchor['p50_us']:.1f}x the anchor")


async def run(tools: ToolSet, ctx: ToolContext, n: int) -> tuple[list[float], ...]:
    """n calls; the total as measured here and the tool's own split (screenshot / OCR / click)."""
    total: list[float] = []
    shot: list[float] = []
    ocr: list[float] = []
    click: list[float] = []
    for _ in range(n):
        t = time.perf_counter()
        result = await tools.call("ui.findAndClick", {"label": "Submit"}, ctx)
        total.append(time.perf_counter() - t)
        assert result.ok, result.error
        parts = result.result["timings_ms"]
        shot.append(parts["screenshot"] / 1e3)
        ocr.append(parts["ocr"] / 1e3)
        click.append(parts["click"] / 1e3)
    return total, shot, ocr, click


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20))
