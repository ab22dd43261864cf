"""A click on the same GTK button three ways, interleaved: by accessibility id (AT-SPI Action.DoAction),
by label through the accessibility tree (`ui.findAndClick`, tree walk + action), and by OCR
find-and-click (`ui.findAndClick` with via=ocr: full-screen grab, OCR, xdotool click) — the anchor.

    python -m bench.desktop_a11y [N]

Runs its own Xvfb, a private D-Bus session bus (whose org.a11y.Bus starts a private AT-SPI bus) and
the GTK program bench/kit/gtk_app.py under Debian's /usr/bin/python3 (python3-gi, gir1.2-gtk-3.0,
at-spi2-core). A try succeeds when the tool says ok and the program logs the click (waited for outside
the timing). The OCR engine does a fresh pass every call, as after any change on screen.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from bench._stats import spread, summary
from bench.desktop import start_xvfb, wait_for_line
from tether.tools.context import ToolContext
from tether.tools.desktop.ocr import OcrEngine
from tether.tools.desktop.tool import desktop_toolset
from tether.tools.policy.model import Policy

GTK_APP = Path(__file__).resolve().parent / "kit" / "gtk_app.py"
BLOCK = 20


def start_session_bus(display: str, runtime: Path) -> tuple[subprocess.Popen[bytes], str]:
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "DISPLAY": display, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("AT_SPI_BUS_ADDRESS", None)
    proc = subprocess.Popen(["dbus-daemon", "--session", "--nofork", "--print-address=1"], env=env,
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    address = proc.stdout.readline().decode().strip()
    if not address:
        raise SystemExit("dbus-daemon did not start (apt-get install dbus)")
    return proc, address


def submits(log: Path) -> int:
    return sum(json.loads(x)["event"] == "submit" for x in log.read_text().splitlines())


async def main(n: int) -> None:
    xvfb, display = start_xvfb()
    with TemporaryDirectory() as tmp:
        bus_proc, bus = start_session_bus(display, Path(tmp) / "run")
        log = Path(tmp) / "events.jsonl"
        env = {**os.environ, "DISPLAY": display, "DBUS_SESSION_BUS_ADDRESS": bus, "XDG_RUNTIME_DIR": f"{tmp}/run"}
        app = subprocess.Popen(["/usr/bin/python3", str(GTK_APP), str(log)], env=env)
        try:
            wait_for_line(log, "ready", 1)
            engine = OcrEngine(reuse_unchanged=False)
            engine.warm_up()
            tools = desktop_toolset(display=display, ocr=engine, session_bus=bus)
            ctx = ToolContext(policy=Policy())
            tree = (await tools.call("get_ui_tree", {}, ctx)).result
            submit = next(e["id"] for e in tree["elements"] if e["name"] == "Submit")
            ways: dict[str, tuple[str, dict[str, Any]]] = {
                "by id (AT-SPI DoAction)": ("click_element", {"control_id": submit}),
                "by label through the tree": ("ui.findAndClick", {"label": "Submit", "via": "accessibility"}),
                "anchor: OCR find-and-click": ("ui.findAndClick", {"label": "Submit", "via": "ocr"}),
            }
            for name, args in ways.values():  # warm-up: first passes size ONNX Runtime's buffers
                assert (await tools.call(name, args, ctx)).ok
            times: dict[str, list[float]] = {k: [] for k in ways}
            ok: dict[str, int] = dict.fromkeys(ways, 0)
            for i in range(n):
                order = list(ways) if i % 2 == 0 else list(reversed(ways))
                for way in order:
                    name, args = ways[way]
                    before = submits(log)
                    t = time.perf_counter()
                    result = await tools.call(name, args, ctx)
                    times[way].append(time.perf_counter() - t)
                    if result.ok:
                        try:
                            wait_for_line(log, "submit", before + 1, timeout=10)
                            ok[way] += 1
                        except SystemExit:
                            pass
            await tools.aclose()
        finally:
            app.terminate()
            app.wait(10)
            bus_proc.terminate()
            bus_proc.wait(10)
            xvfb.terminate()
            xvfb.wait(10)

    print(f"one click on the GTK 'Submit' button, {n} tries each way, interleaved, 1280x800 Xvfb, "
          f"{os.cpu_count()} CPUs")
    rows = {}
    for way, samples in times.items():
        rows[way] = summary(f"{way}", samples)
        medians = [statistics.median(samples[j:j + BLOCK]) * 1e3 for j in range(0, len(samples), BLOCK)]
        print(f"    success {ok[way]}/{n}; medians of blocks of {BLOCK} (ms): {spread(medians)}")
    anchor = rows["anchor: OCR find-and-click"]["p50_us"]
    for way in list(ways)[:2]:
        print(f"{way}: p50 {rows[way]['p50_us'] / 1e3:.1f} ms, {anchor / rows[way]['p50_us']:.0f}x faster than "
              f"the OCR anchor's p50 {anchor / 1e3:.0f} ms")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 100))
