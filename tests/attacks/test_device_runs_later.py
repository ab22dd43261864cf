"""Red team (session 35): planting code that the device itself runs later, outside any sandbox.

The device starts its stdio MCP servers itself at every start (most often unsandboxed), imports its
`module:` servers into its own process, and its own code at its next start. An agent holding `execute`
(not `approve`) tries to plant code in each of those places through every tool: a shell command (`tee`,
a symlink, a hard link, renaming a parent directory), the file tools, and a sandboxed MCP server's own
write tool. Each write must wait for a person (or, for a live process, be refused), and the file on disk
must stay as it was. One device serves the module; HOME is a fresh directory under /var/tmp.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.kits.confined_device import SessionCaller, require
from tether.device.config import parse_device_config
from tether.device.local import LocalDevice, build_device
from tether.device.server_programs import own_programs
from tether.protocol.models import Command, Result, ResultStatus
from tether.tools.policy.model import policy_from_mapping

pytestmark = pytest.mark.asyncio(loop_scope="module")
SERVERS = Path(__file__).resolve().parent.parent / "servers"
# the policy's other approval rules are all off: what holds these writes is the protected list alone
POLICY = {"approval": {"delete": False, "move": False, "overwrite_outside_temp": False}}
EVIL = "import os\nos.system('id > /tmp/pwned')\n"
VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"


OWN_VENV_DEVICE = """
import asyncio, json, sys
from tether.device.local import build_device
from tether.protocol.models import Command
from tether.tools.policy.model import policy_from_mapping

async def main():
    device = build_device(policy=policy_from_mapping({}), state_dir=sys.argv[1], sandbox=False)
    try:
        await device.computer_manager.get_or_create(None)
        [result] = await device.dispatcher(session_id="own").execute_commands([Command(
            tool_name="write_file", parameters={"file_path": sys.argv[2], "content": "import os"})])
    finally:
        await device.aclose()
    print("REPORT " + json.dumps({"prefix": sys.prefix, "result": result.result}))

asyncio.run(main())
"""


class Attacker(SessionCaller):
    async def boxed(self, tool: str, **params: str) -> Result:
        """A call to the sandboxed server's own tool (it writes the write roots live)."""
        [result] = await self.device.client.execute_actions([Command(tool_name=f"boxed/{tool}", parameters=params)])
        return result


def _text(result: Result) -> str:
    return ((result.error or "") + "\n" + json.dumps(result.result))[:1500]


def _held(result: Result, place: Path | str) -> None:
    assert result.status is ResultStatus.FAILURE, f"went through without a person: {_text(result)}"
    assert isinstance(result.result, dict) and result.result.get("needs_approval") is True, _text(result)
    assert result.result["rule"] == f"protected-path: {place}", _text(result)


def _venv(where: Path) -> Path:
    """A virtual environment as `python -m venv` lays it out (pyvenv.cfg, bin/python a symlink to the real
    interpreter, lib/pythonX.Y/site-packages), whose site-packages reaches this checkout's packages by a .pth."""
    real = Path(os.path.realpath(sys.executable))
    (where / "bin").mkdir(parents=True)
    (where / "bin/python").symlink_to(real)
    (where / "pyvenv.cfg").write_text(f"home = {real.parent}\ninclude-system-site-packages = false\n"
                                      f"version = {'.'.join(map(str, sys.version_info[:3]))}\n")
    site = where / "lib" / VERSION / "site-packages"
    site.mkdir(parents=True)
    (site / "checkout.pth").write_text(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    return site


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def attacker() -> AsyncIterator[Attacker]:
    require("bwrap", "bubblewrap")
    home = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-runs-later-")).resolve()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        _venv(home / "envs/srv")
        (home / "current").symlink_to(home / "envs/srv")  # the config names the venv through this link
        (home / "srv").mkdir()
        shutil.copy(SERVERS / "annotated.py", home / "srv/server.py")
        (home / "lib/agentpkg").mkdir(parents=True)  # a package in ~/lib, on the import path after ~ itself
        (home / "lib/agentpkg/__init__.py").write_text("")
        shutil.copy(SERVERS / "module_server.py", home / "lib/agentpkg/server.py")
        (home / "devsrc").mkdir()  # an editable checkout on the device's own import path
        for directory in ("kitbin", "modsrv", "pylib", "uvproj"):
            (home / directory).mkdir()
        shutil.copy(SERVERS / "annotated.py", home / "modsrv/srvmod.py")
        patch.syspath_prepend(str(home / "devsrc"))
        patch.syspath_prepend(str(home / "lib"))
        patch.syspath_prepend(str(home))
        config = parse_device_config({"mcpServers": {
            # a sandboxed server run by its own venv's python: it writes the write roots live
            "boxed": {"command": str(home / "current/bin/python"), "args": [str(home / "srv/server.py")],
                      "sandbox": True, "autoApprove": ["write_text"], "env": {"PATH": f"{home}/kitbin:/usr/bin:/bin"}},
            # servers started through package runners (not installed here: what matters is their store)
            # unsandboxed, as `python -m` from its own directory, with a PYTHONPATH of its own
            "modrun": {"command": sys.executable, "args": ["-m", "srvmod"], "cwd": str(home / "modsrv"),
                       "env": {"PYTHONPATH": str(home / "pylib")}},
            "npx": {"command": str(home / "runners/npx"), "args": ["-y", "some-mcp-server"]},
            "uvrun": {"command": str(home / "runners/uv"), "args": ["run", "--directory", str(home / "uvproj"), "s"]},
            "uvx": {"command": str(home / "runners/uvx"), "args": ["some-mcp-server"],
                    "env": {"UV_CACHE_DIR": str(home / "uvcache")}}},
            # a server the device imports into its own process
            "mcp": {"default": {"default": {"action": [
                {"namespace": "inproc", "server_type": "local", "module": "agentpkg.server"}]}}}})
        state = home / ".local/state/tether"
        state.mkdir(parents=True)
        device: LocalDevice = build_device(config, policy=policy_from_mapping(POLICY), state_dir=state, sandbox=True)
        try:
            assert device.context.sandbox is not None, "no sandbox was made here (see the log for why)"
            computer = await device.computer_manager.get_or_create(None)
            assert not {"boxed", "inproc", "modrun"} & set(computer.startup_errors), computer.startup_errors
            yield Attacker(device, home, "runs-later")
        finally:
            await device.aclose()
            sys.modules.pop("agentpkg.server", None)
            sys.modules.pop("agentpkg", None)
            shutil.rmtree(home, ignore_errors=True)


async def test_a_servers_virtual_environment_is_held_by_every_route(attacker: Attacker) -> None:
    home = attacker.home
    venv = home / "envs/srv"
    module = venv / "lib" / VERSION / "site-packages/mcp_shadow.py"
    _held(await attacker.call("write_file", file_path=str(module), content=EVIL), venv)
    _held(await attacker.run("tee", str(module), stdin=EVIL), venv)
    _held(await attacker.run("ln", "-s", str(home / "srv/server.py"), str(module)), venv)
    _held(await attacker.run("tee", "-a", str(venv / "pyvenv.cfg"), stdin="home = /var/tmp/evil\n"), venv)
    # renaming the directory above it, to put another one in its place
    _held(await attacker.run("mv", str(home / "envs"), str(home / "envs-old")), venv)
    _held(await attacker.call("move_file", source=str(home / "envs"), destination=str(home / "envs-old")), venv)
    # retargeting the link the config names it by, to run another environment
    (home / "evilenv").mkdir()
    _held(await attacker.run("ln", "-sfn", str(home / "evilenv"), str(home / "current")), home / "current")
    assert os.readlink(home / "current") == str(venv)
    # a hard link made elsewhere to one of its files, to write through later
    linked = await attacker.run("ln", str(venv / "pyvenv.cfg"), str(home / "cfg-link"))
    assert linked.status is ResultStatus.FAILURE and not os.path.lexists(home / "cfg-link"), _text(linked)
    assert f"protected-path: {venv}" in (linked.error or ""), _text(linked)
    # the sandboxed server itself, through its own write tool
    boxed = await attacker.boxed("write_text", path=str(module), text=EVIL)
    assert boxed.status is ResultStatus.FAILURE and "Read-only file system" in (boxed.error or ""), _text(boxed)
    assert not os.path.lexists(module) and "evil" not in (venv / "pyvenv.cfg").read_text()
    assert (home / "envs/srv").is_dir() and not (home / "envs-old").exists()


async def test_a_module_servers_file_and_its_import_path_are_held(attacker: Attacker) -> None:
    home = attacker.home
    package = home / "lib/agentpkg"  # found without importing it; the rule named is the import path entry
    source = package / "server.py"
    original = source.read_text()
    _held(await attacker.call("write_file", file_path=str(source), content=EVIL, mode="overwrite"), home / "lib")
    _held(await attacker.run("tee", str(source), stdin=EVIL), home / "lib")
    _held(await attacker.run("tee", str(package / "__init__.py"), stdin=EVIL), home / "lib")
    _held(await attacker.run("mv", str(package), str(home / "lib/agentpkg-old")), home / "lib")
    assert str(package) in attacker.device.context.policy.protected_paths  # found as the server's, not only as a path
    # ~ comes first on the import path and can't be protected whole: the names that would shadow it there are
    _held(await attacker.run("tee", str(home / "agentpkg.py"), stdin=EVIL), home / "agentpkg.py")
    _held(await attacker.call("write_file", file_path=str(home / "agentpkg/__init__.py"), content=EVIL,
                              create_parents=True), home / "agentpkg")
    boxed = await attacker.boxed("write_text", path=str(source), text=EVIL)
    assert boxed.status is ResultStatus.FAILURE and "Read-only file system" in (boxed.error or ""), _text(boxed)
    assert source.read_text() == original and (package / "__init__.py").read_text() == ""
    assert not (home / "agentpkg.py").exists() and not (home / "agentpkg").exists()


async def test_package_runner_stores_and_a_servers_path_are_held(attacker: Attacker) -> None:
    home = attacker.home
    planted = home / ".npm/_npx/0123abcd/node_modules/some-mcp-server/index.js"
    _held(await attacker.run("mkdir", "-p", str(planted.parent)), home / ".npm/_npx")
    _held(await attacker.call("write_file", file_path=str(planted), content="evil()", create_parents=True),
          home / ".npm/_npx")
    _held(await attacker.run("mkdir", "-p", str(home / "uvcache/archive-v0/x")), home / "uvcache")
    _held(await attacker.run("mkdir", "-p", str(home / ".local/share/uv/tools/some-mcp-server")),
          home / ".local/share/uv")
    # a program the sandboxed server runs by name, from a directory of its PATH
    _held(await attacker.run("tee", str(home / "kitbin/node"), stdin="#!/bin/sh\nid\n"), home / "kitbin")
    # where a server's program imports from: `python -m`'s working directory, its PYTHONPATH, uv run's project
    _held(await attacker.run("tee", str(home / "modsrv/mcp_types.py"), stdin=EVIL), home / "modsrv")
    _held(await attacker.call("write_file", file_path=str(home / "pylib/mcp.py"), content=EVIL), home / "pylib")
    _held(await attacker.run("mkdir", str(home / "uvproj/.venv")), home / "uvproj")
    assert not (home / "modsrv/mcp_types.py").exists() and not (home / "pylib/mcp.py").exists()
    assert not (home / ".npm/_npx").exists() and not (home / "uvcache").exists()
    assert not (home / ".local/share/uv").exists() and not (home / "kitbin/node").exists()
    # what an ordinary `npm install` writes (the content cache) is not held
    cached = await attacker.run("mkdir", "-p", str(home / ".npm/_cacache/index-v5"))
    assert cached.ok, _text(cached)


async def test_the_devices_own_import_path_is_held(attacker: Attacker) -> None:
    home = attacker.home
    _held(await attacker.call("write_file", file_path=str(home / "devsrc/json.py"), content=EVIL), home / "devsrc")
    _held(await attacker.run("tee", str(home / "devsrc/json.py"), stdin=EVIL), home / "devsrc")
    # ~ is first on this device's import path (as for `python -m tether` run from ~): tether itself can't be shadowed
    _held(await attacker.run("tee", str(home / "tether.py"), stdin=EVIL), home / "tether.py")
    assert not (home / "devsrc/json.py").exists() and not (home / "tether.py").exists()
    # a device whose own virtual environment lies in the home directory (a real process run by that venv's python)
    venv = home / "envs/srv"
    site = venv / "lib" / VERSION / "site-packages"
    ran = subprocess.run([str(venv / "bin/python"), "-c", OWN_VENV_DEVICE, str(home / ".local/state/own"),
                          str(site / "evil.py")], env={**os.environ, "HOME": str(home)}, cwd="/",
                         capture_output=True, text=True, timeout=120)
    line = next((ln for ln in ran.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert line, f"the device process failed: {ran.stdout}\n{ran.stderr[-3000:]}"
    report = json.loads(line.removeprefix("REPORT "))
    assert report["prefix"] == str(venv), report
    assert report["result"]["needs_approval"] is True and report["result"]["rule"] == f"protected-path: {venv}", report
    assert not (site / "evil.py").exists()
    # the same, computed for given values: never the home itself
    places = own_programs([str(home)], prefix=str(venv), base_prefix="/usr", executable=str(venv / "bin/python"),
                          path=[str(home), str(site), "", str(home / "missing")])
    # bin/python's real interpreter lies outside; in ~, searched before the real tether, the names that shadow it
    assert places[:2] == [str(venv), str(site)] and str(home) not in places, places
    assert {str(home / "tether"), str(home / "tether.py"), str(site / "tether.py")} <= set(places), places


async def test_programs_left_in_a_projects_venv_or_node_modules_are_named(attacker: Attacker) -> None:
    # not held (every install writes them), but each tool's result names what it left there for the project to run
    home = attacker.home
    proj = home / "proj"
    made = await attacker.call("write_file", file_path=str(proj / ".venv/pyvenv.cfg"), content="home = /usr/bin\n",
                               create_parents=True)
    assert made.ok and "left_programs" not in made.result, _text(made)
    (proj / ".venv/bin").mkdir()
    (proj / "node_modules/jest/bin").mkdir(parents=True)
    (proj / "node_modules/jest/bin/jest.js").write_text("run()\n")
    ran = await attacker.run("tee", str(proj / ".venv/bin/pytest"), stdin="#!/bin/sh\nid\n")
    assert ran.ok and ran.result["left_programs"] == [str(proj / ".venv/bin/pytest")], _text(ran)
    linked = await attacker.run("mkdir", "-p", str(proj / "node_modules/.bin"), str(proj / "bin"))
    assert linked.ok and "left_programs" not in linked.result, _text(linked)
    linked = await attacker.run("ln", "-s", "../jest/bin/jest.js", str(proj / "node_modules/.bin/jest"))
    assert linked.ok and linked.result["left_programs"] == [str(proj / "node_modules/.bin/jest")], _text(linked)
    wrote = await attacker.call("write_file", file_path=str(proj / ".venv/bin/black"), content="#!/bin/sh\nid\n")
    assert wrote.ok and wrote.result["left_programs"] == [str(proj / ".venv/bin/black")], _text(wrote)
    (proj / "tool").write_text("#!/bin/sh\nid\n")
    moved = await attacker.call("move_file", source=str(proj / "tool"), destination=str(proj / "node_modules/.bin/t"))
    assert moved.ok and moved.result["left_programs"] == [str(proj / "node_modules/.bin/t")], _text(moved)
    data = b"#!/bin/sh\nid\n"  # a file sent from another device
    entry = {"path": "", "type": "file", "size": len(data), "mode": 0o755, "sha256": hashlib.sha256(data).hexdigest()}
    begin = await attacker.call("transfer_begin", transfer_id="tleftprog001", dest=str(proj / ".venv/bin/ruff"),
                                kind="file", name="ruff", entries=[entry])
    assert begin.ok, _text(begin)
    put = await attacker.call("write_file_chunk", transfer_id="tleftprog001", root=begin.result["root"], path="",
                              index=0, offset=0, size=len(data), data=base64.b64encode(data).decode())
    assert put.ok, _text(put)
    sent = await attacker.call("transfer_commit", transfer_id="tleftprog001", root=begin.result["root"], path="",
                               index=0, type="file", size=len(data), sha256=entry["sha256"], mode=0o755)
    assert sent.ok and sent.result["left_programs"] == [str(proj / ".venv/bin/ruff")], _text(sent)
    # held for another reason (a protected .envrc beside it), then approved: named once applied
    both = (str(proj / ".venv/bin/tool"), str(proj / ".envrc"))
    held = await attacker.run("tee", *both, stdin="id\n")
    assert held.result.get("needs_approval") is True and "left_programs" not in held.result, _text(held)
    approved = await attacker.run("tee", *both, stdin="id\n", approved_by="alice")
    assert approved.ok and approved.result["left_programs"] == [both[0]], _text(approved)
    # a bin/ that is no virtual environment's, and a deletion, leave nothing to name
    plain = await attacker.run("tee", str(proj / "bin/x"), stdin="x\n")
    assert plain.ok and "left_programs" not in plain.result, _text(plain)
    gone = await attacker.run("rm", str(proj / ".venv/bin/pytest"))
    assert gone.ok and "left_programs" not in gone.result, _text(gone)
