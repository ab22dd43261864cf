"""A full 1280x800 screenshot on Wayland (sway: grim through wlr-screencopy, as the desktop tools take it)
against X11 (Xvfb: mss through XGetImage/XShm, the anchor), interleaved.

    python -m bench.desktop_shot [N]

Starts its own Xvfb and a headless sway (WLR_BACKENDS=headless, pixman; as `nobody` when run as root,
since sway refuses root). Both screens are empty desktops of the same size.
"""

from __future__ import annotations

import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._stats import spread, summary
from bench.desktop import start_xvfb
from tether.tools.desktop.screen import grab_sync
from tether.tools.desktop.sway import SwayWm

BLOCK = 10


def start_sway() -> tuple[subprocess.Popen[bytes], dict[str, str], Path]:
    if shutil.which("sway") is None or shutil.which("grim") is None:
        raise SystemExit("apt-get install sway grim")
    run = Path(tempfile.mkdtemp(prefix="tether-sway-bench-"))
    fifo, config = run / "ready", run / "config"
    os.mkfifo(fifo)
    config.write_text(f"output HEADLESS-1 resolution 1280x800\nexec sh -c 'echo up > {fifo}'\n")
    prefix: list[str] = []
    if os.geteuid() == 0:
        for path in (run, fifo, config):
            os.chown(path, 65534, 65534)
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(run), "XDG_RUNTIME_DIR": str(run),
           "WLR_BACKENDS": "headless", "WLR_RENDERER": "pixman", "WLR_LIBINPUT_NO_DEVICES": "1"}
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    proc = subprocess.Popen([*prefix, "sway", "-c", str(config)], env=env, cwd=run, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    ready, _, _ = select.select([reader], [], [], 20)
    os.close(reader)
    if not ready:
        proc.kill()
        raise SystemExit("sway did not start")
    sock = next(p.name for p in run.iterdir() if p.name.startswith("sway-ipc"))
    return proc, {"XDG_RUNTIME_DIR": str(run), "WAYLAND_DISPLAY": "wayland-1", "SWAYSOCK": str(run / sock)}, run


def main(n: int) -> None:
    xvfb, display = start_xvfb()
    sway, env, run = start_sway()
    try:
        wm = SwayWm(env)
        x11: list[float] = []
        wl: list[float] = []
        for i in range(n + 2):
            pair = [("x11", lambda: grab_sync(display, None)), ("wl", lambda: wm.grab_sync(None))]
            for name, shot in pair if i % 2 == 0 else reversed(pair):
                t = time.perf_counter()
                capture = shot()
                took = time.perf_counter() - t
                assert (capture.width, capture.height) == (1280, 800)
                if i >= 2:  # two warm-up rounds
                    (x11 if name == "x11" else wl).append(took)
    finally:
        sway.terminate()
        sway.wait(10)
        xvfb.terminate()
        xvfb.wait(10)
        shutil.rmtree(run, ignore_errors=True)
    print(f"full 1280x800 screenshot, {n} each, interleaved, {os.cpu_count()} CPUs")
    anchor = summary("anchor: X11 (Xvfb, mss)", x11)
    print(f"    medians of blocks of {BLOCK} (ms): "
          f"{spread([statistics.median(x11[j:j + BLOCK]) * 1e3 for j in range(0, n, BLOCK)])}")
    row = summary("Wayland (sway, grim -t ppm, parsed to BGRA)", wl)
    print(f"    medians of blocks of {BLOCK} (ms): "
          f"{spread([statistics.median(wl[j:j + BLOCK]) * 1e3 for j in range(0, n, BLOCK)])}")
    print(f"Wayland p50 is {row['p50_us'] / anchor['p50_us']:.1f}x the X11 anchor's")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)
