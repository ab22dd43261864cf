"""Run one program from an argv list: stream and cap its output, and leave nothing running behind it.

The program starts in a new session (so in its own process group) and is never run by a shell.
Whatever ends the run early — the caller's timeout arriving as a cancellation, or any error — the
whole group is terminated (SIGTERM, a short grace, then SIGKILL), which takes grandchildren with it:
a tool that only killed its direct child would leave `npm`'s or a script's children running forever.
After a normal exit the group is killed too, so background stragglers do not outlive their command.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.sandbox.egress.proxy import AskFn
    from tether.sandbox.runner import Sandbox

KILL_GRACE_S = 2.0
CHUNK_BYTES = 64 * 1024

# Passed through from the device's own environment: what programs need to find things, speak the
# right language and reach the network through this machine's proxies and CA bundles.
SAFE_ENV_KEYS: tuple[str, ...] = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "TERM", "TMPDIR",
    "TZ", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
)
# Nobody is at a terminal: pagers print, editors return at once (git's ':' means "no editor"),
# and git never waits for a password prompt. Otherwise a command would hang until its timeout.
NONINTERACTIVE_ENV: dict[str, str] = {
    "PAGER": "cat", "GIT_PAGER": "cat", "GIT_EDITOR": ":", "GIT_SEQUENCE_EDITOR": ":", "EDITOR": "true",
    "VISUAL": "true", "GIT_TERMINAL_PROMPT": "0",
}

OutputSink = Callable[[str, bytes], None]


@dataclass(frozen=True, slots=True)
class ProcessResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    duration_s: float
    pid: int
    notes: tuple[str, ...] = ()  # the sandbox's, about this command's confinement
    cpu_s: float | None = None  # CPU seconds used (sandboxed commands: the sandbox measures it)


def safe_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A minimal environment for a command, plus `extra`, instead of the device's whole environment.

    The device process may hold secrets (API keys, tether's own tokens, cloud credentials) that a
    command an LLM chose must not be able to print, and loader or interpreter hooks (LD_PRELOAD,
    PYTHONPATH, NODE_OPTIONS...) that would silently change what an allowed program does. So only
    `SAFE_ENV_KEYS` are passed through; `extra` (already checked by the policy) is laid on top.
    """
    env = {key: os.environ[key] for key in SAFE_ENV_KEYS if key in os.environ}
    env.setdefault("PATH", os.defpath)
    env.setdefault("LANG", "C.UTF-8")
    env |= NONINTERACTIVE_ENV
    env |= dict(extra or {})
    return env


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def terminate_group(proc: asyncio.subprocess.Process, grace: float | None = None) -> None:
    """SIGTERM the process group, wait up to `grace` for the leader, then SIGKILL whatever is left.

    The final SIGKILL is sent even if the leader exited in time: children that ignore SIGTERM,
    or outlive their parent, are still in the group and must go too.
    """
    grace = KILL_GRACE_S if grace is None else grace
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), grace)
    except TimeoutError:
        _signal_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), grace)
    finally:
        _signal_group(proc.pid, signal.SIGKILL)


async def _drain(stream: asyncio.StreamReader, name: str, limit: int,
                 sink: OutputSink | None) -> tuple[bytes, bool]:
    """Read a pipe to its end, keeping at most `limit` bytes; reading on past the cap keeps the child
    from blocking on a full pipe. Only kept bytes reach `sink`, so streaming obeys the same cap."""
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(CHUNK_BYTES):
        room = limit - len(kept)
        if len(chunk) > room:
            truncated = True
            chunk = chunk[:max(room, 0)]
        if chunk:
            kept += chunk
            if sink is not None:
                sink(name, chunk)
    return bytes(kept), truncated


async def _feed(pipe: asyncio.StreamWriter, data: bytes) -> None:
    """Write stdin and close it; a child that exits without reading it all is not an error."""
    try:
        pipe.write(data)
        await pipe.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        pipe.close()


async def run_process(argv: list[str], *, cwd: str, env: dict[str, str] | None, stdin: bytes | None,
                      max_output: int, on_output: OutputSink | None = None,
                      on_start: Callable[[int], None] | None = None,
                      executable: str | None = None, sandbox: Sandbox | None = None,
                      layer: Path | None = None, ask: AskFn | None = None,
                      session: tuple[str | None, int] = (None, 0)) -> ProcessResult:
    """Run `argv` in `cwd` and return its outcome.

    `executable` is the file to run when the caller has resolved it (argv[0] stays what the program
    sees as its name, so its messages read `ls: ...`, not `/usr/bin/ls: ...`). `env` is added to
    `safe_environment()`. `on_output(stream, chunk)` sees output as it arrives (a sink that raises
    aborts the run); `on_start(pid)` lets a caller that may time out report which process it killed.
    Cancellation or any error kills the process group and re-raises.

    With a `sandbox`, the process is started confined by it (`executable` is then required: the file
    the policy checked is the one executed), its writes captured in `layer` if one is given, and a
    kill takes its whole pid namespace; `ask` answers its unlisted hosts (`ask: on-miss`, Sandbox.spawn);
    `session` is (the session id, its process total) for the session's share of processes (Sandbox.spawn).
    """
    if not argv:
        raise ValueError("argv is empty: nothing to run")
    started = time.monotonic()
    proc: Any
    if sandbox is not None:
        proc = await sandbox.spawn(argv, executable=executable or argv[0], cwd=cwd, env=safe_environment(env),
                                   stdin=stdin is not None, layer=layer, ask=ask, session=session[0],
                                   session_processes=session[1])
    else:
        proc = await asyncio.create_subprocess_exec(
            *argv, executable=executable, cwd=cwd, env=safe_environment(env), start_new_session=True,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    tasks: list[asyncio.Task[Any]] = []
    try:
        if on_start is not None:
            on_start(proc.pid)
        assert proc.stdout is not None and proc.stderr is not None
        if stdin is not None:
            assert proc.stdin is not None
            tasks.append(asyncio.create_task(_feed(proc.stdin, stdin)))
        out_task = asyncio.create_task(_drain(proc.stdout, "stdout", max_output, on_output))
        err_task = asyncio.create_task(_drain(proc.stderr, "stderr", max_output, on_output))
        tasks += [out_task, err_task]
        await asyncio.gather(*tasks)
        exit_code = await proc.wait()
    except BaseException:
        for task in tasks:
            task.cancel()
        await (proc.terminate() if sandbox is not None else terminate_group(proc))
        raise
    if sandbox is None:
        _signal_group(proc.pid, signal.SIGKILL)  # background stragglers that closed their pipes
    (stdout, stdout_cut), (stderr, stderr_cut) = out_task.result(), err_task.result()
    return ProcessResult(exit_code=exit_code, stdout=stdout, stderr=stderr, stdout_truncated=stdout_cut,
                         stderr_truncated=stderr_cut, duration_s=time.monotonic() - started, pid=proc.pid,
                         notes=tuple(getattr(proc, "notes", ())), cpu_s=getattr(proc, "cpu_s", None))
