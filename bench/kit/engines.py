"""Private Redis and PostgreSQL instances for tests: real engines from Debian's packages, started on
free loopback ports in temporary directories and stopped after use.

Readiness is the engine's own "ready" line on its log pipe, never a sleep. PostgreSQL refuses to run
as root, so as root the cluster is created and run as the `postgres` user the Debian package adds;
its data directory is a fresh directory under /tmp that user owns (pytest's tmp_path is not
traversable by another user).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.kit import ports

REDIS_INSTALL = "apt-get install -y redis-server"
POSTGRES_INSTALL = "apt-get install -y postgresql"
READY_TIMEOUT_S = 60.0


def _free_port() -> int:
    # not bind(0)-and-release: another process of a parallel run could be handed the same port meanwhile
    return ports.free_port()


def _wait_for_line(proc: subprocess.Popen[str], needle: str, what: str) -> None:
    """Read the engine's log until `needle` appears; fail with the log if it exits or stays silent."""
    seen: list[str] = []
    found = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if needle in line:
                found.set()
                break

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(READY_TIMEOUT_S)
    if not found.is_set():
        proc.kill()
        raise RuntimeError(f"{what} did not become ready; its log:\n{''.join(seen[-40:])}")
    # keep draining so a chatty engine never blocks on a full pipe
    threading.Thread(target=lambda: [None for _ in proc.stdout or ()], daemon=True).start()


def _stop(proc: subprocess.Popen[str], how: signal.Signals = signal.SIGTERM, pid_file: Path | None = None) -> None:
    if proc.poll() is None:
        pid = proc.pid
        if pid_file is not None:
            # the engine itself, not `runuser` in front of it (which does not pass SIGINT on)
            with contextlib.suppress(OSError, ValueError, IndexError):
                pid = int(pid_file.read_text().split()[0])
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, how)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@dataclass
class Engine:
    """A running engine: its URL, and the process, so a test can kill -9 or restart it."""

    url: str
    port: int
    proc: subprocess.Popen[str]
    directory: Path
    argv: list[str]
    ready_line: str
    user: str | None = None
    stop_signal: signal.Signals = signal.SIGTERM
    pid_file: Path | None = None

    def stop(self) -> None:
        _stop(self.proc, self.stop_signal, self.pid_file)

    def restart(self) -> None:
        """Start it again on the same port and data (a Redis or PostgreSQL restart under load)."""
        self.stop()
        self.proc = _spawn(self.argv, self.user)
        _wait_for_line(self.proc, self.ready_line, self.argv[0])


def _spawn(argv: list[str], user: str | None) -> subprocess.Popen[str]:
    if user is not None:
        argv = ["runuser", "-u", user, "--", *argv]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@contextlib.contextmanager
def redis_server() -> Iterator[Engine]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(f"redis-server is not installed; install it with: {REDIS_INSTALL}")
    directory = Path(tempfile.mkdtemp(prefix="tether-redis-"))
    port = _free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(directory), "--protected-mode", "yes"]
    engine = Engine(f"redis://127.0.0.1:{port}/0", port, _spawn(argv, None), directory, argv,
                    "Ready to accept connections")
    try:
        _wait_for_line(engine.proc, engine.ready_line, "redis-server")
        yield engine
    finally:
        engine.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _postgres_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name) or ""]
    if not found[-1]:
        raise RuntimeError(f"PostgreSQL's {name} is not installed; install it with: {POSTGRES_INSTALL}")
    return found[-1]


@contextlib.contextmanager
def postgres_server() -> Iterator[Engine]:
    user = "postgres" if os.geteuid() == 0 else None
    directory = Path(tempfile.mkdtemp(prefix="tether-pg-"))
    if user is not None:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise RuntimeError(f"running as root needs the 'postgres' user; install: {POSTGRES_INSTALL}") from None
        os.chown(directory, entry.pw_uid, entry.pw_gid)
    data, sockets = directory / "data", directory / "run"
    port = _free_port()
    try:
        init = [_postgres_bin("initdb"), "-D", str(data), "-U", "tether", "-A", "trust", "--no-sync", "-E", "UTF8"]
        done = subprocess.run(["runuser", "-u", user, "--", *init] if user else init, capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr or done.stdout}")
        (sockets).mkdir()
        if user is not None:
            os.chown(sockets, pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid)
        argv = [_postgres_bin("postgres"), "-D", str(data), "-p", str(port), "-h", "127.0.0.1",
                "-k", str(sockets), "-c", "fsync=off", "-c", "full_page_writes=off",
                "-c", "synchronous_commit=off", "-c", "max_connections=200"]
        engine = Engine(f"postgresql://tether@127.0.0.1:{port}/postgres", port, _spawn(argv, user),
                        directory, argv, "database system is ready to accept connections", user,
                        # SIGINT is PostgreSQL's fast shutdown: SIGTERM's smart one took 7 s here
                        signal.SIGINT, data / "postmaster.pid")
        try:
            _wait_for_line(engine.proc, engine.ready_line, "postgres")
            yield engine
        finally:
            engine.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
