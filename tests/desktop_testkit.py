"""Helpers for the desktop tests: a private Xvfb, the Tk test program and waiting on its events.

Kept apart from test_desktop.py so the tests read as tests. Nothing here sleeps for a fixed time:
waits poll for an event with a deadline and fail saying what never happened.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import select
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

GUI_APP = Path(__file__).resolve().parent / "gui_app.py"
TITLE = "Tether Test App"
SCREEN = (1280, 800)
APT = {"Xvfb": "apt-get install xvfb", "xdotool": "apt-get install xdotool", "xdpyinfo": "apt-get install x11-utils"}


def require_programs() -> None:
    for program, install in APT.items():
        if shutil.which(program) is None:
            pytest.fail(f"{program} is not installed; install it with: {install}")
    for module in ("mss", "PIL", "rapidocr_onnxruntime"):
        try:
            __import__(module)
        except ImportError:
            pytest.fail(f"Python module {module} is missing; install it with: pip install -e '.[desktop]'")


@contextmanager
def running_xvfb(log: Path) -> Iterator[str]:
    """A private Xvfb 1280x800; it picks a free display itself (-displayfd) and reports it when ready.

    `-noreset`: by default an X server resets when its last client disconnects, and a connection
    attempted during the reset fails — between two tests nothing else may be connected.
    """
    read_fd, write_fd = os.pipe()
    with open(log, "wb") as err:
        proc = subprocess.Popen(["Xvfb", "-displayfd", str(write_fd), "-screen", "0", f"{SCREEN[0]}x{SCREEN[1]}x24",
                                 "-nolisten", "tcp", "-noreset"],
                                pass_fds=(write_fd,), stdout=subprocess.DEVNULL, stderr=err)
    os.close(write_fd)
    try:
        number = b""
        deadline = time.monotonic() + 20
        while not number.endswith(b"\n"):
            ready, _, _ = select.select([read_fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(read_fd, 64) if ready else b""
            if not chunk:
                pytest.fail(f"Xvfb did not report a display within 20 s: {log.read_text(errors='replace')}")
            number += chunk
        display = f":{int(number)}"
        while subprocess.run(["xdpyinfo", "-display", display], capture_output=True, timeout=10).returncode != 0:
            if time.monotonic() > deadline:
                pytest.fail(f"Xvfb on {display} does not accept connections: {log.read_text(errors='replace')}")
            time.sleep(0.05)
        yield display
    finally:
        os.close(read_fd)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def xdo(display: str, *args: str) -> str:
    return subprocess.run(["xdotool", *args], env={**os.environ, "DISPLAY": display}, capture_output=True,
                          text=True, timeout=10).stdout


async def until(what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
    """Poll `check` until it returns something truthy; fail after `timeout` saying what never happened."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.02)


@dataclass
class GuiApp:
    """The running Tk program and its event log."""

    proc: subprocess.Popen[bytes]
    log: Path

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        rows = [json.loads(line) for line in self.log.read_text().splitlines() if line.endswith("}")]
        return [r for r in rows if kind is None or r["event"] == kind]

    async def wait_event(self, kind: str, timeout: float = 15.0, **fields: Any) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            return next((e for e in self.events(kind) if all(e.get(k) == v for k, v in fields.items())), None)

        return await until(f"event {kind} {fields or ''} (log: {self.events()})", find, timeout)


async def stop(proc: subprocess.Popen[bytes], display: str, title: str) -> None:
    if proc.poll() is None:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 10)
    await until(f"window {title!r} to disappear", lambda: not xdo(display, "search", "--name", title).strip())


def png(data: bytes) -> Any:
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()
    assert img.format == "PNG"
    return img
