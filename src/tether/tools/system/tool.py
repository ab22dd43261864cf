"""Built-in system tools: what this machine is, what runs on it, and starting / closing programs.

psutil reads `/proc` synchronously, and a process listing or a stuck network mount can take a while,
so the readers run in a worker thread and never block the event loop. CPU percentages are taken
with `interval=None` (usage since the previous call) rather than sampling for a second.
Launching goes through the same command policy as the shell (`check_command`), and closing is
refused for pid 1, this device's own process and its parents, and anything another user owns.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Annotated, Any

import psutil
from pydantic import Field

from tether.sandbox import SandboxUnavailable
from tether.sandbox.layers.session import SessionLimit
from tether.tools.context import ToolContext
from tether.tools.errors import PolicyDenied, ToolError
from tether.tools.policy.command_checks import check_command
from tether.tools.policy.jail import check_cwd
from tether.tools.running.process import safe_environment
from tether.tools.runtime import ToolSet, tool
from tether.tools.system.info import get_system_info

# what a graphical program needs to find its display; the rest of the device's environment stays out
GUI_ENV_KEYS = ("DISPLAY", "XAUTHORITY", "WAYLAND_DISPLAY", "XDG_RUNTIME_DIR", "XDG_SESSION_TYPE")

logger = logging.getLogger(__name__)

_CMDLINE_LIMIT = 300
_GRACE_SECONDS = 3.0
_KILL_WAIT_SECONDS = 3.0


# ------------------------------------------------------------------------------------------ processes


def _short_cmdline(cmdline: list[str] | None) -> str:
    text = " ".join(cmdline or [])
    return text if len(text) <= _CMDLINE_LIMIT else text[: _CMDLINE_LIMIT - 3] + "..."


def _matches(info: dict[str, Any], needle: str) -> bool:
    """Scripts show up under their interpreter or their own name, so both are searched."""
    names = [info.get("name") or ""]
    if info.get("cmdline"):
        names.append(os.path.basename(info["cmdline"][0]))
    return any(needle in n.lower() for n in names)


@tool(tool_type="data_collection")
async def list_processes(name: str | None = None, limit: int = 200) -> dict[str, Any]:
    """List running processes (by pid), optionally only those whose name contains `name`."""
    if limit <= 0:
        raise ToolError("limit must be > 0")
    needle = name.lower() if name else None

    def collect() -> dict[str, Any]:
        rows = []
        attrs = ["pid", "name", "username", "cpu_percent", "memory_percent", "cmdline", "status"]
        for proc in psutil.process_iter(attrs, ad_value=None):
            info = proc.info
            if needle is not None and not _matches(info, needle):
                continue
            rows.append({"pid": info["pid"], "name": info["name"], "username": info["username"],
                         "cpu_percent": info["cpu_percent"],
                         "memory_percent": round(info["memory_percent"] or 0.0, 2),
                         "status": info["status"], "cmdline": _short_cmdline(info["cmdline"])})
        rows.sort(key=lambda r: r["pid"])
        return {"processes": rows[:limit], "count": min(len(rows), limit), "total": len(rows),
                "truncated": len(rows) > limit}

    return await asyncio.to_thread(collect)


@tool(tool_type="action")
async def launch_application(ctx: ToolContext, app_name: str, args: list[str] = [],  # noqa: B006
                             cwd: str | None = None,
                             waitForWindowMs: Annotated[int, Field(ge=0, le=30_000)] = 0,
                             ) -> dict[str, Any]:
    """Start a program detached from this device (own session, no terminal) and return its pid;
    with `waitForWindowMs` on an X display or a sway session, also wait (at most that long) for its
    window and report it.

    The program and its arguments must pass the same command policy as the shell (and the shell's
    check of where the executable lives); it is run from an argv list, never through a shell.
    """
    from tether.tools.shell.tool import require_sandbox, resolve_program  # the shell set's module: when launching

    decision = check_command(ctx.policy, app_name, list(args))
    if not decision.allowed:
        raise PolicyDenied(decision.rule, decision.reason)
    # The shell's resolver: an explicit path inside the writable roots (anything could have been
    # placed there under an allowed name) or a link to sudo & co. is refused the same way.
    executable = resolve_program(ctx, app_name)
    if cwd is None:
        home = str(Path.home())
        try:
            workdir = check_cwd(ctx.policy, home, ctx.secrets)
        except PolicyDenied:
            workdir = check_cwd(ctx.policy, ctx.temp_dir, ctx.secrets)
    else:
        workdir = check_cwd(ctx.policy, cwd, ctx.secrets)
    require_sandbox(ctx, f"launching {app_name}")
    watcher = await _WindowWatch.start() if waitForWindowMs > 0 else None
    env = safe_environment({k: os.environ[k] for k in GUI_ENV_KEYS if k in os.environ})
    try:
        if ctx.sandbox is not None:
            # no overlay: an application outlives the call, so it writes only to live_write_roots; a GUI
            # program reaches its display's socket, and no other (the filter refuses unix sockets)
            proc: Any = await ctx.sandbox.spawn([app_name, *args], executable=executable, cwd=str(workdir), env=env,
                                                stdin=False, layer=None, output=False,
                                                display_socket=_display_socket(env),
                                                session=ctx.session_id,
                                                session_processes=ctx.policy.limits.session_processes,
                                                session_tmp=False)  # it outlives the session's /tmp
        else:
            proc = await asyncio.create_subprocess_exec(
                app_name, *args, executable=executable, cwd=workdir, env=env, start_new_session=True,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL)
    except SessionLimit as exc:
        raise ToolError(f"denied by limit '{exc.rule}': {exc}", {"limit": exc.rule, "applied": False}) from None
    except (OSError, SandboxUnavailable) as exc:
        raise ToolError(f"could not start {app_name!r}: {exc}") from None
    _reap_when_done(proc, app_name)
    result: dict[str, Any] = {"pid": proc.pid, "app_name": app_name, "argv": [app_name, *args],
                              "executable": executable, "cwd": str(workdir),
                              "sandbox": ctx.sandbox.kind if ctx.sandbox is not None else "none"}
    if waitForWindowMs > 0:
        result.update(await _WindowWatch.report(watcher, proc, waitForWindowMs))
    return result


def _display_socket(env: dict[str, str]) -> str | None:
    """The one display socket a launched program may reach: the X display's when $DISPLAY is set (the
    desktop tools drive X first too), else the Wayland compositor's; None when there is neither."""
    if env.get("DISPLAY"):
        from tether.tools.desktop.x11 import display_socket

        return display_socket(env["DISPLAY"])
    if env.get("WAYLAND_DISPLAY"):
        from tether.tools.desktop.wayland import wayland_socket

        return wayland_socket(env)
    return None


class _WindowWatch:
    """Waiting for a launched program's window (only when asked, and only on an X display or sway).

    The windows visible before the launch are noted, so a program that does not publish its pid
    on its window (`_NET_WM_PID`; Tk does not) is still found as "the new window".
    """

    def __init__(self, wm: Any, known: set[int]) -> None:
        self.wm, self.known = wm, known

    @classmethod
    async def start(cls) -> _WindowWatch | str:
        display = os.environ.get("DISPLAY")
        if not display and os.environ.get("WAYLAND_DISPLAY"):
            from tether.tools.desktop.sway import SwayWm
            from tether.tools.desktop.wayland import sway_problem

            env = dict(os.environ)
            problem = await asyncio.to_thread(sway_problem, env)
            if problem:
                return problem
            sway = SwayWm(env)
            return cls(sway, await sway.visible_windows())
        from tether.tools.desktop.x11 import X11, display_problem

        problem = await asyncio.to_thread(display_problem, display)
        if problem or display is None:
            return problem or "no X display or sway session"
        x11 = X11(display)
        return cls(x11, await x11.visible_windows())

    @staticmethod
    async def report(watcher: _WindowWatch | str | None, proc: asyncio.subprocess.Process,
                     wait_ms: int) -> dict[str, Any]:
        if not isinstance(watcher, _WindowWatch):
            return {"window": None, "window_note": f"not waiting for a window: {watcher}"}
        win, how = await watcher.wm.wait_for_window(pid=proc.pid, timeout=wait_ms / 1000, known=watcher.known,
                                                     alive=lambda: proc.returncode is None)
        if win is None:
            why = "the program exited" if how == "exited" else f"none appeared within {wait_ms} ms"
            return {"window": None, "window_note": f"no window: {why}"}
        return {"window": {**win.as_dict(), "matched_by": how}}


def _reap_when_done(proc: asyncio.subprocess.Process, app_name: str) -> None:
    """Await the child's exit so it is reaped (no zombie) and its exit is logged.

    No registry holds the task: asyncio's child watcher keeps the transport alive while the child
    runs, the transport keeps the `wait()` future, and that future keeps this task.
    """
    def done(task: asyncio.Task[int]) -> None:
        if not task.cancelled() and task.exception() is None:
            logger.debug("%s (pid %d) exited with %s", app_name, proc.pid, task.result())

    asyncio.get_running_loop().create_task(proc.wait(), name=f"reap {app_name} {proc.pid}").add_done_callback(done)


def _protected_pids() -> set[int]:
    """Closing any of these would take the device down (or the machine): never allowed."""
    me = psutil.Process()
    return {0, 1, me.pid} | {p.pid for p in me.parents()}


def _owned(proc: psutil.Process, uid: int) -> bool:
    try:
        return proc.uids().real == uid
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _select_targets(pid: int | None, name: str | None) -> list[psutil.Process]:
    uid = os.getuid()
    protected = _protected_pids()
    if pid is not None:
        if pid in protected:
            raise PolicyDenied("process.protected",
                               f"pid {pid} is init, this device or one of its parents and is never closed")
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            raise ToolError(f"no process with pid {pid}") from None
        if not _owned(proc, uid):
            raise PolicyDenied("process.other_user", f"pid {pid} belongs to another user (only uid {uid}'s "
                               "processes may be closed)")
        roots = [proc]
    else:
        roots = [p for p in psutil.process_iter(["name", "uids"], ad_value=None)
                 if p.info["name"] == name and p.info["uids"] is not None and p.info["uids"].real == uid
                 and p.pid not in protected]
        if not roots:
            raise ToolError(f"no process named {name!r} owned by uid {uid} (closable ones exclude this device)")
    targets: dict[int, psutil.Process] = {}
    for root in roots:
        targets[root.pid] = root
        try:
            family = root.children(recursive=True) + _session_members(root.pid)
        except psutil.NoSuchProcess:
            continue
        for proc in family:
            if proc.pid not in protected and _owned(proc, uid):
                targets.setdefault(proc.pid, proc)
    return list(targets.values())


def _session_members(pid: int) -> list[psutil.Process]:
    """A launched app leads its own session; helpers it daemonised are no longer its children but
    stay in that session, so closing the app finds them here."""
    try:
        if os.getsid(pid) != pid or os.getsid(0) == pid:
            return []
    except OSError:
        return []
    members = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != pid and os.getsid(proc.pid) == pid:
                members.append(proc)
        except OSError:
            continue
    return members


def _close(targets: list[psutil.Process], force: bool) -> dict[str, Any]:
    """Signal everyone, then wait on their exits (psutil.wait_procs), escalating to SIGKILL after a grace."""
    failed: list[dict[str, Any]] = []
    signalled: list[psutil.Process] = []
    for proc in targets:
        try:
            proc.kill() if force else proc.terminate()
            signalled.append(proc)
        except psutil.NoSuchProcess:
            signalled.append(proc)  # already gone: wait_procs reports it as closed
        except psutil.AccessDenied as exc:
            failed.append({"pid": proc.pid, "error": f"access denied: {exc}"})
    gone, alive = psutil.wait_procs(signalled, timeout=_KILL_WAIT_SECONDS if force else _GRACE_SECONDS)
    # A zombie has exited; only its parent can reap it (an init may reap slowly), so it counts as closed.
    gone += [p for p in alive if _is_zombie(p)]
    alive = [p for p in alive if p not in gone]
    killed = []
    for proc in alive:
        try:
            proc.kill()
            killed.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
        except psutil.AccessDenied as exc:
            failed.append({"pid": proc.pid, "error": f"access denied: {exc}"})
    if alive:
        more, alive = psutil.wait_procs(alive, timeout=_KILL_WAIT_SECONDS)
        gone += more + [p for p in alive if _is_zombie(p)]
        failed += [{"pid": p.pid, "error": "still running after SIGKILL"} for p in alive if p not in gone]
    return {"closed": sorted(p.pid for p in gone), "killed": sorted(killed), "failed": failed}


def _is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@tool(tool_type="action")
async def close_application(pid: int | None = None, name: str | None = None, force: bool = False) -> dict[str, Any]:
    """Close a program and its children: by pid, or every process of this user with exactly `name`.

    SIGTERM first so the program can save its work (SIGKILL at once with `force`); whatever is
    still running after a grace period is killed. Returns the pids that are gone.
    """
    if (pid is None) == (name is None):
        raise ToolError("give exactly one of 'pid' or 'name'")
    if name is not None and not name:
        raise ToolError("name must not be empty")

    def work() -> dict[str, Any]:
        result = _close(_select_targets(pid, name), force)
        if not result["closed"]:
            raise ToolError(f"nothing was closed: {result['failed']}", result)
        return result

    return await asyncio.to_thread(work)


def system_toolset() -> ToolSet:
    """A fresh tool set each call (no shared registry)."""
    return ToolSet("system", [get_system_info, list_processes, launch_application, close_application],
                   description="machine information, processes, starting and closing programs")
