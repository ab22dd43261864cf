"""Helpers for the desktop tests: a private Xvfb, the Tk test program and waiting on its events.

Kept apart from test_desktop.py so the tests read as tests. Nothing here sleeps or polls: the Tk
program's event log is a FIFO read as a stream, a window's end is its DestroyNotify (seen by xev),
and every wait has a deadline and fails saying what never happened.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

GUI_APP = Path(__file__).resolve().parents[2] / "bench" / "kit" / "gui_app.py"
GTK_APP = Path(__file__).resolve().parents[2] / "bench" / "kit" / "gtk_app.py"
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, with python3-gi and gir1.2-gtk-3.0 (the venv's cannot import gi)
TITLE = "Tether Test App"
SCREEN = (1280, 800)
APT = {"Xvfb": "apt-get install xvfb", "xdotool": "apt-get install xdotool", "xdpyinfo": "apt-get install x11-utils",
       "xev": "apt-get install x11-utils"}


def require_programs() -> None:
    for program, install in APT.items():
        if shutil.which(program) is None:
            pytest.fail(f"{program} is not installed; install it with: {install}")
    for module in ("mss", "PIL", "rapidocr_onnxruntime"):
        try:
            __import__(module)
        except ImportError:
            pytest.fail(f"Python module {module} is missing; install it with: pip install -e '.[desktop]'")


def require_a11y() -> None:
    """The accessibility tests' programs: a D-Bus daemon, at-spi2-core, and GTK 3 for the system Python."""
    if shutil.which("dbus-daemon") is None:
        pytest.fail("dbus-daemon is not installed; install it with: apt-get install dbus")
    if not Path("/usr/libexec/at-spi-bus-launcher").exists():
        pytest.fail("at-spi2-core is not installed; install it with: apt-get install at-spi2-core")
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import gi; gi.require_version('Gtk', '3.0')"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.fail(f"GTK 3 for {SYSTEM_PYTHON} is missing ({probe.stderr.strip().splitlines()[-1:]}); install "
                    "it with: apt-get install python3-gi gir1.2-gtk-3.0")


@contextmanager
def running_session_bus(display: str | None, runtime_dir: Path) -> Iterator[str]:
    """A private D-Bus session bus (its address): org.a11y.Bus on it starts a private accessibility bus.

    The bus launcher is started by this daemon on first use and inherits its environment: `DISPLAY` (it
    publishes the bus on that display's root window) and `XDG_RUNTIME_DIR` (a private folder, so its
    socket is not shared with anything else on the machine). It exits when this session bus goes away.
    """
    runtime_dir.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir)}
    env.pop("AT_SPI_BUS_ADDRESS", None)
    env.pop("DISPLAY", None)
    if display is not None:  # None: a Wayland session, no X display at all
        env["DISPLAY"] = display
    proc = subprocess.Popen(["dbus-daemon", "--session", "--nofork", "--print-address=1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        address = proc.stdout.readline().decode().strip() if ready else ""
        if not address:
            pytest.fail(f"dbus-daemon gave no address within 20 s (exit code {proc.poll()})")
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def running_sway() -> Iterator[dict[str, str]]:
    """A headless sway (WLR_BACKENDS=headless, pixman rendering, no input devices) and the environment
    its clients need. Sway refuses to run as root, so under root it runs as `nobody`, in a runtime folder
    of its own directly under the temp dir (pytest's are closed to other users). Ready is said by sway
    itself: its config's `exec` writes to a FIFO read here; its exit is seen through a pidfd."""
    if shutil.which("sway") is None:
        pytest.fail("sway is not installed; install it with: apt-get install sway")
    runtime_dir = Path(tempfile.mkdtemp(prefix="tether-sway-"))
    fifo = runtime_dir / "ready"
    os.mkfifo(fifo)
    config = runtime_dir / "config"
    config.write_text(f"output HEADLESS-1 resolution 1280x800\nexec sh -c 'echo up > {fifo}'\n")
    as_nobody: list[str] = []
    if os.geteuid() == 0:
        for path in (runtime_dir, fifo, config):
            os.chown(path, 65534, 65534)
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(runtime_dir),
           "XDG_RUNTIME_DIR": str(runtime_dir), "WLR_BACKENDS": "headless", "WLR_RENDERER": "pixman",
           "WLR_LIBINPUT_NO_DEVICES": "1"}
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    with open(runtime_dir / "sway.log", "wb") as log:
        proc = subprocess.Popen([*as_nobody, "sway", "-c", str(config)], env=env, cwd=runtime_dir,
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    exited = os.pidfd_open(proc.pid)
    try:
        ready, _, _ = select.select([reader, exited], [], [], 20)
        if reader not in ready or not os.read(reader, 16):
            pytest.fail(f"sway did not start within 20 s: {(runtime_dir / 'sway.log').read_text(errors='replace')}")
        sock = next(p.name for p in runtime_dir.iterdir() if p.name.startswith("sway-ipc"))
        yield {"XDG_RUNTIME_DIR": str(runtime_dir), "WAYLAND_DISPLAY": "wayland-1",
               "SWAYSOCK": str(runtime_dir / sock)}
    finally:
        os.close(reader)
        os.close(exited)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(runtime_dir, ignore_errors=True)


@contextmanager
def running_xvfb(log: Path) -> Iterator[str]:
    """A private Xvfb 1280x800; it picks a free display itself (-displayfd) and reports it when ready.

    Xvfb writes the display number only once it accepts connections, so one xdpyinfo confirms it.

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
        info = subprocess.run(["xdpyinfo", "-display", display], capture_output=True, text=True, timeout=10)
        if info.returncode != 0:
            pytest.fail(f"Xvfb reported {display} but it does not accept connections: {info.stderr.strip()}; "
                        f"Xvfb log: {log.read_text(errors='replace')}")
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


class EventLog:
    """The Tk program's event log as a FIFO, read as a stream (JSON lines, one per event).

    Made and opened for reading (non-blocking) before the program starts: the program opens the path
    with "a", which for a FIFO waits until a reader has it. A write end of our own stays open so the
    FIFO never reports end-of-file, even after the program exits. `str(log)` is the path to pass it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        os.mkfifo(path)
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self._keep_open = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        self._finalizer = weakref.finalize(self, _close_fds, self.fd, self._keep_open)
        self._partial = b""
        self._ready: asyncio.Future[None] | None = None
        self.rows: list[dict[str, Any]] = []

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:
        return str(self.path)

    def drain(self) -> None:
        """Take in whatever the program has written so far; never blocks."""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                return
            *lines, self._partial = (self._partial + chunk).split(b"\n")
            self.rows.extend(json.loads(line) for line in lines if line.strip())

    async def readable(self) -> None:
        """Return when the FIFO has data. One reader on the running loop, shared by concurrent waiters,
        removed once it fired (each asyncio.run has its own loop)."""
        loop = asyncio.get_running_loop()
        if self._ready is None or self._ready.done() or self._ready.get_loop() is not loop:
            ready = self._ready = loop.create_future()

            def fire() -> None:
                loop.remove_reader(self.fd)
                if not ready.done():
                    ready.set_result(None)

            loop.add_reader(self.fd, fire)
        await asyncio.shield(self._ready)

    def close(self) -> None:
        self._finalizer()


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


@dataclass
class GuiApp:
    """The running Tk program and its event log (an EventLog made before the program started)."""

    proc: subprocess.Popen[bytes]
    log: EventLog

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        self.log.drain()
        return [r for r in self.log.rows if kind is None or r["event"] == kind]

    async def wait_event(self, kind: str, timeout: float = 15.0, **fields: Any) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            return next((e for e in self.events(kind) if all(e.get(k) == v for k, v in fields.items())), None)

        try:
            async with asyncio.timeout(timeout):
                while (found := find()) is None:
                    await self.log.readable()
                return found
        except TimeoutError:
            exited = "" if self.proc.poll() is None else f"; the program exited with {self.proc.returncode}"
            pytest.fail(f"timed out after {timeout:g}s waiting for event {kind} {fields or ''} "
                        f"(log: {self.events()}){exited}")


    async def wait_count(self, kind: str, n: int, timeout: float = 15.0) -> dict[str, Any]:
        """The `n`th event of `kind` (1-based), waited for (for a program that serves several tests)."""
        try:
            async with asyncio.timeout(timeout):
                while len(self.events(kind)) < n:
                    await self.log.readable()
                return self.events(kind)[n - 1]
        except TimeoutError:
            pytest.fail(f"timed out after {timeout:g}s waiting for {kind} event #{n} (log: {self.events()})")


class WindowGone:
    """xev watching a window's structure events, started before the window is closed; see `watch_window`."""

    def __init__(self, title: str, watchers: list[asyncio.subprocess.Process]) -> None:
        self.title = title
        self.watchers = watchers

    async def wait(self, what: str | None = None, timeout: float = 15.0) -> None:
        what = what or f"window {self.title!r} to disappear"
        try:
            async with asyncio.timeout(timeout):
                for xev in self.watchers:
                    await _destroyed(xev)
        except TimeoutError:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what} (no DestroyNotify from xev)")
        finally:
            for xev in self.watchers:
                if xev.returncode is None:
                    xev.kill()
                    await xev.wait()


async def _destroyed(xev: asyncio.subprocess.Process) -> None:
    assert xev.stdout is not None and xev.stderr is not None
    async for line in xev.stdout:
        if b"DestroyNotify" in line:
            return
    err = (await xev.stderr.read()).decode(errors="replace")
    await xev.wait()
    if "BadWindow" not in err:  # BadWindow: the window was gone before xev could watch it
        pytest.fail(f"xev ended ({xev.returncode}) without a DestroyNotify: {err.strip()}")


async def watch_window(display: str, title: str) -> WindowGone:
    """Start watching every window named `title` for its DestroyNotify; none found means already gone.

    Call before terminating or closing the program, then `await (...).wait()`.
    """
    env = {**os.environ, "DISPLAY": display}
    ids = xdo(display, "search", "--name", title).split()
    watchers = [await asyncio.create_subprocess_exec("xev", "-id", wid, "-event", "structure", env=env,
                                                     stdout=asyncio.subprocess.PIPE,
                                                     stderr=asyncio.subprocess.PIPE) for wid in ids]
    return WindowGone(title, watchers)


async def stop(proc: subprocess.Popen[bytes], display: str, title: str) -> None:
    gone = await watch_window(display, title)
    if proc.poll() is None:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 10)
    await gone.wait()


def png(data: bytes) -> Any:
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()
    assert img.format == "PNG"
    return img
