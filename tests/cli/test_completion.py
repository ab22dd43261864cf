"""Shell completion of the names a server knows (devices, a device's tools, tasks), asked of a real server
by the installed `tether` through click's completion protocol, silent when no server answers; and `tether
undo` against a server telling a local session apart, with the way to undo it here."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from tests.kits.netutil import free_port
from tests.kits.task import AgentServer
from tether.tools.journal import UndoJournal
from tether.tools.policy.model import default_policy

TETHER = str(Path(sys.executable).parent / "tether")


def complete(words: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """What bash completion gets for the command line `words` (its last word being completed)."""
    parts = words.split(" ")
    return subprocess.run([TETHER], capture_output=True, text=True, timeout=60, check=False,
                          env={**env, "_TETHER_COMPLETE": "complete_bash", "COMP_WORDS": words,
                               "COMP_CWORD": str(len(parts) - 1)})


async def test_names_complete_from_the_server_and_nothing_without_one(tmp_path: Path) -> None:
    root = tmp_path / "alpha"
    root.mkdir()
    policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        await server.add_device("beta", policy, tmp_path / "state-beta")
        task = await server.create(device="alpha", plan=[{"skill": "teleport", "args": {}}])
        env = {**os.environ, "TETHER_SERVER": f"http://127.0.0.1:{server.port}", "TETHER_TOKEN": server.token,
               "TETHER_STATE_DIR": str(tmp_path / "local-state")}
        devices = await asyncio.to_thread(complete, "tether devices rm ", env)
        assert devices.returncode == 0 and devices.stdout.split() == ["alpha", "beta"], devices
        only = await asyncio.to_thread(complete, "tether devices rm al", env)
        assert only.stdout.split() == ["alpha"]
        tools = await asyncio.to_thread(complete, "tether exec --device alpha shell.r", env)
        assert tools.stdout.split() == ["shell.run"], tools
        tasks = await asyncio.to_thread(complete, "tether log ", env)
        assert task["id"][:12] in tasks.stdout.split(), tasks

        UndoJournal(tmp_path / "local-state").record("s2", "write", root / "made.txt")  # a local session
        undone = await asyncio.to_thread(subprocess.run, [TETHER, "undo", "s2"], capture_output=True, text=True,
                                         timeout=60, env=env)
        assert undone.returncode == 1, undone
        assert "local" in undone.stderr and "tether undo s2 --local" in undone.stderr.replace("\n", " "), undone.stderr
    gone = {**env, "TETHER_SERVER": f"http://127.0.0.1:{free_port()}"}
    silent = await asyncio.to_thread(complete, "tether devices rm ", gone)
    assert silent.returncode == 0 and silent.stdout.split() == [] and silent.stderr == ""
