"""What `tether device` does, without typer or click: the command's body (`run_device`) and the device token's
handling, so that `tether.cli.fast` runs the device from a parsed command line at the cost of what it needs
alone. The typer command (`device.py`) parses the same options and calls `run_device` as well."""

from __future__ import annotations

import ctypes
import gc
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tether.cli.views.safe_text import console, say

if TYPE_CHECKING:
    from tether.device.config import DeviceConfig


DEVICE_TOKEN_ENV = "TETHER_DEVICE_TOKEN"  # noqa: S105 (a variable name)
# automatic collections while the device starts: none below this many new container objects (Python's own is
# 700). Start-up makes ~90k objects that all live on (modules, classes, models, tool schemas) and little garbage,
# and the default collected ~125 times, walking the survivors again each time (docs/startup.md)
START_UP_GC_THRESHOLD = 100_000
REFUSED_ON_COMMAND_LINE = (
    "--token is not accepted: a token on a command line is visible to every user of the machine "
    "(ps, /proc/PID/cmdline); use --token-file PATH or the TETHER_DEVICE_TOKEN environment variable")


def _scrub_initial_environ(name: str) -> bool:
    """Overwrite the value of `name=…` in this process's environment strings, in place. True if done.

    Removing a variable (os.environ.pop → unsetenv) only takes libc's *pointer* to the "NAME=value"
    string out of the `environ` array; the bytes stay where the kernel put them at exec, in the
    initial environment block on the stack, and /proc/PID/environ (readable by the same user, hence
    by anything the device starts outside a sandbox) is read by the kernel from exactly that block.
    So while `environ` still points at the string, zero its value bytes through ctypes; then unsetenv.
    Linux (glibc or musl, which export `environ`) only; elsewhere there is no /proc/PID/environ.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        environ = ctypes.POINTER(ctypes.c_void_p).in_dll(libc, "environ")
    except (OSError, ValueError):
        return False
    libc.strncmp.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)
    libc.strncmp.restype = ctypes.c_int
    libc.strlen.argtypes = (ctypes.c_void_p,)
    libc.strlen.restype = ctypes.c_size_t
    prefix = name.encode() + b"="
    done = False
    index = 0
    while (entry := environ[index]) is not None:  # NULL ends the array
        if libc.strncmp(entry, prefix, len(prefix)) == 0:
            length = libc.strlen(entry)
            ctypes.memset(entry + len(prefix), 0, length - len(prefix))
            done = True
        index += 1
    return done


def take_device_token_from_env(name: str = DEVICE_TOKEN_ENV) -> str | None:
    """The device token from the environment, which then holds no trace of it: not os.environ, not
    libc's environ (so no child inherits it), not /proc/PID/environ (see _scrub_initial_environ)."""
    value = os.environ.get(name)
    if value is None:
        return None
    _scrub_initial_environ(name)
    os.environ.pop(name, None)  # unsetenv as well
    return value.strip() or None


def read_token_file(path: Path, warn: Callable[[str], None]) -> str:
    """The token in `path` (surrounding whitespace dropped); a file others may read gets a warning."""
    try:
        with path.open(encoding="utf-8") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            token = handle.read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read token file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"token file {path} is not text: {exc.reason}") from exc
    if not token:
        raise ValueError(f"token file {path} is empty")
    if mode & 0o077:
        warn(f"token file {path} can be read by other users (mode {stat.S_IMODE(mode):04o}): chmod 600 {path}")
    return token


class StartUpCollection:
    """The collector's young-generation threshold raised to `START_UP_GC_THRESHOLD` while `tether device`
    starts (`pause`), put back as it was (`resume`: idempotent) once the link has a first outcome —
    registered, disconnected, refused or stopped — before a pairing waits for a person, and when
    `run_device` returns or raises. A bound, not an off switch: past that many new objects it collects."""

    def __init__(self) -> None:
        self._saved: tuple[int, int, int] | None = None

    def pause(self) -> None:
        """Raise the young threshold (once; a second call keeps the first saved thresholds)."""
        if self._saved is None:
            self._saved = gc.get_threshold()
            gc.set_threshold(max(START_UP_GC_THRESHOLD, self._saved[0]), *self._saved[1:])

    def resume(self) -> None:
        """The thresholds as they were before `pause` (nothing if not paused, or already resumed)."""
        saved, self._saved = self._saved, None
        if saved is not None:
            gc.set_threshold(*saved)


def run_device(env_token: str | None, *, server: list[str] | None, token_file: Path | None, token: str | None,
               name: str | None, config: Path | None, policy: Path | None, state_dir: Path | None,
               ca_file: str | None, tag: list[str] | None, pair: bool, tls_fingerprint: str | None,
               log_level: str, log_format: str, allow_root: bool) -> int:
    """`tether device` with its options as the command parsed them (`env_token`: TETHER_DEVICE_TOKEN, already
    taken out of the environment by `take_device_token_from_env`). Serves commands until stopped; the result
    is the exit code (0 stopped, 2 bad usage, configuration or token, 3 refused by the server). Raises
    SystemExit(2) for a problem found before connecting (said on stderr in one line)."""
    if token is not None:
        _error(REFUSED_ON_COMMAND_LINE)
        raise SystemExit(2)
    collection = StartUpCollection()
    collection.pause()
    try:
        return _run_device(env_token, collection, server=server, token_file=token_file, name=name, config=config,
                           policy=policy, state_dir=state_dir, ca_file=ca_file, tag=tag, pair=pair,
                           tls_fingerprint=tls_fingerprint, log_level=log_level, log_format=log_format,
                           allow_root=allow_root)
    finally:
        collection.resume()


def _run_device(env_token: str | None, collection: StartUpCollection, *, server: list[str] | None,
                token_file: Path | None, name: str | None, config: Path | None, policy: Path | None,
                state_dir: Path | None, ca_file: str | None, tag: list[str] | None, pair: bool,
                tls_fingerprint: str | None, log_level: str, log_format: str, allow_root: bool) -> int:
    """`run_device` past the refused --token, with the start-up's collection paused (`collection`)."""
    from tether.device.config import load_device_config, server_url_problem

    servers = [url.strip() for each in server or () for url in each.split(",") if url.strip()]
    for url in servers:  # before anything starts: one line naming it
        if (problem := server_url_problem(url)) is not None:
            _error(f"--server: {problem}")
            raise SystemExit(2)
    from tether.device.root import RootRefused, root_check

    try:
        cfg = load_device_config(config)
        for url in () if servers else cfg.server.ws_urls():  # the config's, as --server's above
            if (problem := server_url_problem(url)) is not None:
                raise ValueError(f"the config's server: {problem}")
        root_warning = root_check(cfg, allow_root, "tether device")  # before a token is read or a pairing asked
        secret = _device_token(cfg, token_file, env_token)
    except (ValueError, RootRefused) as exc:
        _error(str(exc))
        raise SystemExit(2) from None
    from tether.device.local import device_state_dir, hold_state_dir
    from tether.errors import DeviceError

    try:  # one device process per state directory, before anything in it is read or written (kept till exit)
        state_lock = hold_state_dir(device_state_dir(cfg, state_dir))
    except DeviceError as exc:  # the refusal alone: this process does not run
        _error(str(exc))
        raise SystemExit(2) from None
    try:
        return _serve(cfg, servers, secret, root_warning, collection, token_file=token_file, name=name,
                      policy=policy, state_dir=state_dir, ca_file=ca_file, tag=tag, pair=pair,
                      tls_fingerprint=tls_fingerprint, log_level=log_level, log_format=log_format)
    finally:
        os.close(state_lock)


def _serve(cfg: DeviceConfig, servers: list[str], secret: str | None, root_warning: str | None,
           collection: StartUpCollection, *,
           token_file: Path | None, name: str | None, policy: Path | None,
           state_dir: Path | None, ca_file: str | None, tag: list[str] | None, pair: bool,
           tls_fingerprint: str | None, log_level: str, log_format: str) -> int:
    """`run_device` past its checks, with the state directory held: logging, pairing where no token was given,
    then serving until stopped (the exit code)."""
    if root_warning:
        _warn(root_warning)
    from tether.cli.views.logs import configure

    try:
        configure(log_level, log_format)
    except ValueError as exc:
        _error(str(exc))
        raise SystemExit(2) from None

    enrolment = None
    if not secret:
        collection.resume()  # a pairing waits for a person: collected as usual meanwhile
        from tether.cli.commands.fleet.pairing import enrol  # httpx and the admin commands: only without a token
        from tether.protocol.names import device_name_problem

        if name and (problem := device_name_problem(name)) is not None:  # as the server checks it, before asking
            _error(f"--name: {problem}")
            raise SystemExit(2)

        enrolment = enrol(cfg, servers[0] if servers else None, state_dir, name, ca_file, tls_fingerprint, pair)
        if name and enrolment.name and name != enrolment.name:  # the admin named it when approving
            _warn(f"paired as {enrolment.name}: --name {name} is not used (the token is {enrolment.name}'s)")
        secret, name = enrolment.token, enrolment.name or name
        tls_fingerprint = tls_fingerprint or enrolment.tls_fingerprint
    secret_files = [str(p) for p in (token_file, cfg.server.token_file) if p]
    tags = [*(enrolment.tags if enrolment else []), *(tag or [])]
    return _device(cfg, servers, secret, name, policy, state_dir, ca_file, tags, secret_files, collection,
                   tls_fingerprint)


def _device_token(cfg: DeviceConfig, token_file: Path | None, env_token: str | None) -> str | None:
    """--token-file, else TETHER_DEVICE_TOKEN, else the config's server.token_file (or server.token)."""
    if token_file is not None:
        return read_token_file(token_file.expanduser(), _warn)
    if env_token:
        return env_token
    if cfg.server.token_file:
        path = Path(cfg.server.token_file).expanduser()
        if not path.is_absolute() and cfg.source:
            path = Path(cfg.source).parent / path
        return read_token_file(path, _warn)
    return cfg.server.token


def _error(message: str) -> None:
    say(f"error: {message}", err=True, soft_wrap=True)  # one line, whatever the width; never markup


def _warn(message: str) -> None:
    say(f"warning: {message}", err=True, soft_wrap=True)


def _device(cfg: DeviceConfig, servers: list[str], secret: str, name: str | None, policy: Path | None,
            state_dir: Path | None, ca_file: str | None, tags: list[str], secret_files: list[str],
            collection: StartUpCollection, tls_fingerprint: str | None = None) -> int:
    from rich.markup import escape

    from tether.device.link.connection import DeviceConnection, RegistrationRefused
    from tether.device.link.reconnect import PIN_MISMATCH
    from tether.device.serve import ServedDevice, serve_device

    out = console(err=True)
    several = False  # a cluster's nodes: say which one

    def ready(served: ServedDevice) -> None:
        nonlocal several
        several = len(served.urls) > 1
        confined, sandbox = served.local.context.sandbox, served.sandbox
        why = sandbox.detail if not sandbox.available else "the policy turns it off (sandbox: false)"
        if confined is not None:
            out.print(f"sandbox: {confined.kind} ({sandbox.detail})", soft_wrap=True, markup=False)
        elif served.local.policy.require_sandbox:
            _warn(f"no sandbox: this device will refuse to start processes (the policy's require_sandbox; set it "
                  f"to false to run them unconfined); {why}")
        else:
            _warn(f"no sandbox: processes this device starts run unconfined; {why}")
        out.print(f"connecting to {', '.join(served.urls)} …", soft_wrap=True, markup=False)

    def announce(state: str, conn: DeviceConnection) -> None:
        if state in ("registered", "disconnected", "refused", "stopped"):  # the link's first outcome; when
            collection.resume()  # registered, serve_device has frozen the start-up's objects already
        if state == "registered":
            again = " (reconnected)" if conn.connections > 1 else ""
            via = f" via {escape(conn.url)}" if several else ""  # which node of a cluster
            out.print(f"[green]registered as {escape(str(conn.registered_as))}[/green]{via}{again}; serving commands",
                      soft_wrap=True)
        elif state == "disconnected":
            out.print(f"[yellow]disconnected[/yellow]{': ' + escape(str(conn.last_error)) if conn.last_error else ''}; "
                      "reconnecting")

    try:
        serve_device(servers or None, token=secret, config=cfg, name=name, policy_path=policy, state_dir=state_dir,
                     ca_file=ca_file, tls_fingerprint=tls_fingerprint, tags=tags, secret_files=secret_files,
                     on_state=announce, on_ready=ready, freeze_gc=True,
                     lock_state_dir=False)  # _run_device holds it from before the token is read
    except ValueError as exc:
        _error(str(exc))
        return 2
    except RegistrationRefused as exc:
        if exc.code == PIN_MISMATCH:
            out.print(f"[red]not connecting:[/red] {escape(exc.error)}", soft_wrap=True)
        else:
            out.print(f"[red]refused by the server:[/red] {escape(str(exc))}", soft_wrap=True)
        return 3
    out.print("device stopped")
    return 0
