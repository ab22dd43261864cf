"""System tools against the real machine: info, processes, launching and closing real programs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.kits.results import failed, ok
from tether.protocol.models import Result
from tether.tools.context import ToolContext
from tether.tools.policy.model import CommandRule, Policy
from tether.tools.system.tool import system_toolset


async def call(tool_name: str, ctx: ToolContext | None = None, /, **args: Any) -> Result:
    return await system_toolset().call(tool_name, args, ctx or ToolContext(policy=Policy()))


def reap_task(pid: int) -> asyncio.Task[Any]:
    """The task launch_application left to reap this child: awaiting it waits on the exit itself.

    Only pending tasks are listed, so look it up right after the launch, before anything awaits.
    """
    [task] = [t for t in asyncio.all_tasks() if t.get_name().startswith("reap ") and
              t.get_name().endswith(f" {pid}")]
    return task


def gone(pid: int) -> bool:
    """Exited *and* reaped: a zombie still has a process entry, so it does not count."""
    try:
        psutil.Process(pid)
    except psutil.NoSuchProcess:
        return True
    return False


@pytest.fixture
def unique_sleep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A copy of `sleep` under a name no other test on this machine uses, so closing by name is safe."""
    name = "tsl" + uuid.uuid4().hex[:8]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    sleep = shutil.which("sleep")
    assert sleep, "sleep not found: apt-get install coreutils"
    shutil.copy2(sleep, bindir / name)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return name


@dataclass
class Launcher:
    ctx: ToolContext
    reapers: dict[int, asyncio.Task[Any]] = field(default_factory=dict)

    async def launch(self, app_name: str, *args: str) -> int:
        res = ok(await call("launch_application", self.ctx, app_name=app_name, args=list(args)))
        assert res["argv"] == [app_name, *args]
        self.reapers[res["pid"]] = reap_task(res["pid"])
        return res["pid"]


@pytest.fixture
async def launcher(tmp_path: Path, unique_sleep: str) -> AsyncIterator[Launcher]:
    """A context allowed to launch `sleep`, `true` and the unique sleeper; kills whatever a test leaves."""
    rules = {"sleep": CommandRule(), "true": CommandRule(), unique_sleep: CommandRule()}
    # the sleeper's bin directory lies outside the write roots: a program found inside them is refused
    (tmp_path / "work").mkdir()
    policy = Policy(read_roots=[str(tmp_path)], write_roots=[str(tmp_path / "work")], commands=rules)
    launcher = Launcher(ToolContext(policy=policy, session_id="s1", temp_dir=str(tmp_path)))
    yield launcher
    for pid, task in launcher.reapers.items():
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
        await asyncio.wait_for(task, 10)


# ------------------------------------------------------------------------------------------ info


SECTION_KEYS = {
    "cpu": {"model", "cores", "threads", "frequency_mhz", "percent"},
    "memory": {"total", "available", "total_gb", "available_gb"},
    "disk": {"disks"},
    "network": {"hostname", "interfaces"},
    "os": {"platform", "release", "version", "python"},
}


@pytest.mark.parametrize("info_type", sorted(SECTION_KEYS))
async def test_system_info_each_section(info_type: str) -> None:
    res = ok(await call("get_system_info", info_type=info_type))
    assert list(res) == [info_type]
    assert SECTION_KEYS[info_type] <= set(res[info_type])


async def test_system_info_values_make_sense() -> None:
    res = ok(await call("get_system_info"))
    assert set(res) == set(SECTION_KEYS)
    assert res["cpu"]["threads"] >= 1 and isinstance(res["cpu"]["model"], str)
    assert 0 < res["memory"]["available"] <= res["memory"]["total"]
    root = next(d for d in res["disk"]["disks"] if d["path"] == "/")
    assert 0 <= root["free"] <= root["total"]
    assert "lo" in res["network"]["interfaces"] or res["network"]["interfaces"]
    assert res["os"]["python"] == ".".join(map(str, sys.version_info[:3]))


async def test_bad_info_type_names_the_argument() -> None:
    failed(await call("get_system_info", info_type="gpu"), "info_type")


# ------------------------------------------------------------------------------------------ processes


async def test_list_processes_finds_this_python() -> None:
    res = ok(await call("list_processes", name="python"))
    mine = [p for p in res["processes"] if p["pid"] == os.getpid()]
    assert mine, res
    assert mine[0]["username"] and "python" in (mine[0]["cmdline"] + mine[0]["name"]).lower()
    everything = ok(await call("list_processes", limit=1))
    assert everything["count"] == 1 and everything["truncated"] and everything["total"] > 1
    failed(await call("list_processes", limit="3"), "limit")


async def test_launch_and_close(launcher: Launcher, tmp_path: Path) -> None:
    pid = await launcher.launch("sleep", "60")
    proc = psutil.Process(pid)
    # the launch returns once exec(2) passed its point of no return (the close-on-exec pipe closed); the
    # kernel sets the new argv a moment later, so an empty cmdline can be read in between on a busy machine
    deadline = time.monotonic() + 10
    while not proc.cmdline() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert proc.cmdline() == ["sleep", "60"] and proc.status() != psutil.STATUS_ZOMBIE
    assert os.getsid(pid) == pid  # detached: its own session
    assert Path(proc.cwd()) == tmp_path.resolve()  # home is outside the roots, so the temp dir

    closed = ok(await call("close_application", launcher.ctx, pid=pid))
    assert closed["closed"] == [pid] and closed["killed"] == []
    assert gone(pid)  # close_application waited for the exit; nothing is left, not even a zombie
    await asyncio.wait_for(launcher.reapers[pid], 10)


async def test_launched_program_is_reaped_when_it_exits(launcher: Launcher) -> None:
    pid = await launcher.launch("true")
    assert await asyncio.wait_for(launcher.reapers[pid], 10) == 0
    assert gone(pid)  # reaped, not a zombie


async def test_close_by_name_closes_every_instance(launcher: Launcher, unique_sleep: str) -> None:
    pids = [await launcher.launch(unique_sleep, "60") for _ in range(2)]
    assert {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == unique_sleep} == set(pids)
    res = ok(await call("close_application", launcher.ctx, name=unique_sleep))
    assert sorted(res["closed"]) == sorted(pids)
    assert all(gone(pid) for pid in pids)
    failed(await call("close_application", launcher.ctx, name=unique_sleep), "no process named")


async def test_close_takes_the_children_too(launcher: Launcher) -> None:
    ctx = launcher.ctx
    shell = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & echo ready; wait"], stdout=subprocess.PIPE,
                             start_new_session=True)
    try:
        assert shell.stdout is not None and shell.stdout.readline() == b"ready\n"  # both children forked
        children = [c.pid for c in psutil.Process(shell.pid).children()]
        assert len(children) == 2
        res = ok(await call("close_application", ctx, pid=shell.pid, force=True))
        assert sorted(res["closed"]) == sorted([shell.pid, *children])
        assert all(gone(pid) for pid in children)
    finally:
        shell.kill()
        shell.wait()
        shell.stdout.close()  # type: ignore[union-attr]


async def test_close_takes_daemonised_helpers_of_its_session(launcher: Launcher) -> None:
    # the subshell forks a sleep and exits: the orphan is no longer anyone's child, but stays in the session
    leader = subprocess.Popen(["sh", "-c", "(sleep 60 & echo $!); exec sleep 60"], stdout=subprocess.PIPE,
                              start_new_session=True)
    try:
        assert leader.stdout is not None
        orphan = int(leader.stdout.readline())
        subshell = psutil.Process(orphan).parent()
        if subshell is not None and subshell.pid != leader.pid and subshell.pid != 1:
            with contextlib.suppress(psutil.NoSuchProcess):
                subshell.wait(timeout=10)  # the subshell exits right after the echo: wait for that event
        assert orphan not in [c.pid for c in psutil.Process(leader.pid).children(recursive=True)]
        res = ok(await call("close_application", launcher.ctx, pid=leader.pid))
        assert sorted(res["closed"]) == sorted([leader.pid, orphan])
        assert gone(orphan)
    finally:
        leader.kill()
        leader.wait()
        leader.stdout.close()  # type: ignore[union-attr]


async def test_a_program_ignoring_sigterm_is_killed_after_the_grace(launcher: Launcher,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tether.tools.system.tool._GRACE_SECONDS", 0.2)
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; echo ready; exec sleep 60"], stdout=subprocess.PIPE,
                                start_new_session=True)
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
        res = ok(await call("close_application", launcher.ctx, pid=stubborn.pid))
        assert res["closed"] == [stubborn.pid] and res["killed"] == [stubborn.pid]
        assert gone(stubborn.pid)
    finally:
        stubborn.kill()
        stubborn.wait()
        stubborn.stdout.close()  # type: ignore[union-attr]


@pytest.mark.parametrize("who", ["init", "self", "parent"])
async def test_close_refuses_protected_processes(who: str) -> None:
    pid = {"init": 1, "self": os.getpid(), "parent": os.getppid()}[who]
    failed(await call("close_application", pid=pid), "denied", "process.protected")
    assert psutil.pid_exists(pid)


async def test_close_refuses_other_users_processes() -> None:
    if os.getuid() == 0:
        other = subprocess.Popen(["sleep", "60"], user=65534, start_new_session=True)
        pid = other.pid
    else:
        other = None
        pid = next((p.pid for p in psutil.process_iter(["uids"])
                    if p.info["uids"] and p.info["uids"].real != os.getuid() and p.pid != 1), 0)
        if not pid:  # CI runs as root and takes the branch above; say what this run lacks instead of skipping
            pytest.fail("needs root (to start a process as nobody) or a process of another user on this machine")
    try:
        failed(await call("close_application", pid=pid), "denied", "process.other_user")
        assert psutil.pid_exists(pid)
    finally:
        if other is not None:
            other.kill()
            other.wait()


async def test_close_argument_errors() -> None:
    failed(await call("close_application"), "exactly one")
    failed(await call("close_application", pid=1, name="x"), "exactly one")
    dead = subprocess.Popen(["true"])
    dead.wait()
    failed(await call("close_application", pid=dead.pid), "no process with pid")
    failed(await call("close_application", pid="12"), "pid")


async def test_launch_refusals(launcher: Launcher, unique_sleep: str) -> None:
    ctx = launcher.ctx
    failed(await call("launch_application", ctx, app_name="sleep", args=["1"], cwd="/"), "denied", "read_roots")
    failed(await call("launch_application", ctx, app_name="sleep", args=[1]), "args")
    strict = ToolContext(policy=Policy(commands={}), temp_dir=ctx.temp_dir)
    failed(await call("launch_application", strict, app_name="sleep", args=["1"]), "denied by policy rule")
    planted = ctx.policy.write_roots[0] + "/" + unique_sleep  # allowed by name, but it lives where tools can write
    shutil.copy2(str(shutil.which(unique_sleep)), planted)
    failed(await call("launch_application", ctx, app_name=planted, args=["1"]), "escape.writable-executable")
    # found by name only inside the write roots: refused too, not run
    bare = ToolContext(policy=Policy(read_roots=ctx.policy.read_roots, write_roots=[str(Path(planted).parent)],
                                     commands={"planted-tether": CommandRule()}), temp_dir=ctx.temp_dir)
    shutil.copy2(planted, Path(planted).parent / "planted-tether")
    os.environ["PATH"] = f"{Path(planted).parent}{os.pathsep}{os.environ['PATH']}"
    failed(await call("launch_application", bare, app_name="planted-tether"), "escape.writable-executable",
           "only found")
    missing = ToolContext(policy=Policy(commands={"no-such-program-tether": CommandRule()}))
    failed(await call("launch_application", missing, app_name="no-such-program-tether"), "not on PATH")


def test_toolset_is_fresh_and_typed() -> None:
    first, second = system_toolset(), system_toolset()
    assert first is not second
    assert {i.name: i.tool_type for i in first.infos()} == {
        "get_system_info": "data_collection", "list_processes": "data_collection",
        "launch_application": "action", "close_application": "action"}
