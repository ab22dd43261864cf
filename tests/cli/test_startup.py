"""issue 13, fast start-up: what a command imports, checked by looking at `sys.modules` in a real `tether`
process (never by timing). `tether --help` lists every command without importing a command module;
a command imports its own module and not the server, the agent, `mcp` or a browser it does not use."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

import tether.cli.commands
import tether.cli.commands.setup
from tests.kits.netutil import tether_env
from tether.cli.common import app
from tether.cli.lazy import COMMANDS, all_modules, expand

HEAVY = ("mcp", "fastapi", "openai", "playwright", "uvicorn", "starlette", "jwt")

# Runs `tether ARGS` in this interpreter and writes, at exit, the names of every module it imported.
_HARNESS = """
import atexit, json, sys
out = sys.argv[1]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
sys.argv = ["tether", *sys.argv[2:]]
from tether.cli import main
main()
"""


# The same, also saying on stderr each change of the collector's thresholds and each freeze, as it happens.
_GC_HARNESS = """
import gc, sys
set_threshold, freeze = gc.set_threshold, gc.freeze
def logged_threshold(*args):
    print("gc-threshold", *args, file=sys.stderr, flush=True)
    set_threshold(*args)
def logged_freeze():
    print("gc-freeze", file=sys.stderr, flush=True)
    freeze()
gc.set_threshold, gc.freeze = logged_threshold, logged_freeze
print("gc-start", *gc.get_threshold(), file=sys.stderr, flush=True)
""" + _HARNESS


def _imported(tmp_path: Path, *args: str) -> tuple[set[str], subprocess.CompletedProcess]:
    out = tmp_path / "modules.json"
    out.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-c", _HARNESS, str(out), *args], env=tether_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    return set(json.loads(out.read_text())), proc


def _top(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


def _full_root() -> Any:
    # every module of every family: each attaches its commands
    for module in pkgutil.walk_packages(tether.cli.commands.__path__, "tether.cli.commands."):
        importlib.import_module(module.name)
    return typer.main.get_command(app)


def _tree(command: Any) -> dict[str, Any]:
    return {name: _tree(sub) for name, sub in sorted(getattr(command, "commands", {}).items())}


def test_the_table_names_every_command_with_its_own_help_line() -> None:
    root = _full_root()
    assert set(root.commands) == set(COMMANDS), (
        f"tether.cli.lazy.COMMANDS must list every top-level command: {set(root.commands) ^ set(COMMANDS)}")
    wrong = {name: (COMMANDS[name].help, command.get_short_help_str(limit=1000))
             for name, command in root.commands.items()
             if COMMANDS[name].help != command.get_short_help_str(limit=1000)}
    assert not wrong, f"tether.cli.lazy.COMMANDS says another help line than the command: {wrong}"
    for module in expand(all_modules()):
        assert importlib.util.find_spec(f"tether.cli.commands.{module}") is not None, module
    # a pattern stands for the modules it matches: `tether mcp`'s sub-command modules are found by name
    assert {"fleet.tools", "setup.server"} <= set(expand(("fleet.*", "setup.*")))
    assert expand(("setup.mcp_*",)) == sorted(f"setup.{m.name}" for m in
                                              pkgutil.iter_modules(tether.cli.commands.setup.__path__)
                                              if m.name.startswith("mcp_"))


def test_a_command_loaded_alone_is_the_whole_command(tmp_path: Path) -> None:
    """Each command built from only the modules the table names for it has every sub-command it has
    when all modules are imported: a module missing from the table would lose one."""
    full = _tree(_full_root())
    script = ("import json, sys, typer\nfrom tether.cli.common import app\n"
              "root = typer.main.get_command(app)\nctx = typer.Context(root)\n"
              "def tree(c):\n    return {n: tree(s) for n, s in sorted(getattr(c, 'commands', {}).items())}\n"
              "print(json.dumps(tree(root.get_command(ctx, sys.argv[1]))))\n")
    for name in COMMANDS:
        proc = subprocess.run([sys.executable, "-c", script, name], env=tether_env(tmp_path),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == full[name], (
            f"tether {name}: add the module that attaches its sub-commands to tether.cli.lazy.COMMANDS[{name!r}]")


def test_root_help_lists_every_command_and_imports_no_command_module(tmp_path: Path) -> None:
    modules, proc = _imported(tmp_path, "--help")
    assert proc.returncode == 0
    for name, lazy in COMMANDS.items():
        assert f"│ {name} " in proc.stdout, name
        assert lazy.help.split()[0] in proc.stdout
    loaded = {m.removeprefix("tether.cli.") for m in modules if m.startswith("tether.cli.")}
    # drawn from what typer drew (tether.cli.fast.help): neither typer nor a command module
    assert loaded <= {"fast", "fast.help", "fast.help_data"}, loaded
    assert not _top(modules) & {"typer", "click"} and not modules & {"rich.markdown", "rich.traceback", "rich.syntax"}
    assert not _top(modules) & {*HEAVY, "pydantic", "httpx"}, sorted(_top(modules) & {*HEAVY, "pydantic", "httpx"})
    assert "tether.protocol" not in modules and "asyncio" not in modules
    assert "logging" not in modules, "drawing the help logs nothing"


@pytest.mark.parametrize("args", [("device", "--help"), ("server", "--help"), ("exec", "--help"),
                                  ("tools", "serve", "--help"), ("run", "--help"), ("devices", "--help"),
                                  ("mcp", "--help"), ("token", "--help"), ("policy", "--help")])
def test_a_commands_help_imports_none_of_the_heavy_libraries(tmp_path: Path, args: tuple[str, ...]) -> None:
    modules, proc = _imported(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr
    assert "Usage: tether" in proc.stdout
    assert not _top(modules) & set(HEAVY), sorted(_top(modules) & set(HEAVY))
    assert not modules & {"rich.markdown", "rich.traceback"}, "help panels need neither (tether.cli.views.rich_help)"


def test_a_local_built_in_tool_call_imports_no_sdk_server_or_http_client(tmp_path: Path) -> None:
    modules, proc = _imported(tmp_path, "exec", "get_system_info", "info_type=os", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "typer.rich_utils" not in modules, "a command that runs draws no help panel"
    assert json.loads(proc.stdout)["status"] == "success"
    assert not _top(modules) & {*HEAVY, "mcp_types", "httpx"}, sorted(_top(modules) & {*HEAVY, "mcp_types", "httpx"})
    # the AIP frames, the device profile and the codec are for a device on a link (tether.protocol is lazy)
    assert not modules & {"tether.protocol.messages", "tether.protocol.profile", "tether.protocol.codec"}


def test_a_local_call_without_config_files_or_a_display_loads_neither_yaml_nor_the_desktop_tools(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """yaml is imported to read a config or policy file, the desktop tools' modules when a display and
    their extra are there: with neither, `tether exec` (and a device) never imports them."""
    for name in ("TETHER_CONFIG", "TETHER_POLICY", "DISPLAY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-config"))
    modules, proc = _imported(tmp_path, "exec", "get_system_info", "info_type=os", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "yaml" not in modules
    assert not {m for m in modules if m.startswith("tether.tools.desktop.")} - {"tether.tools.desktop.x11"}


def test_an_unknown_command_is_a_usage_error_that_loads_nothing(tmp_path: Path) -> None:
    modules, proc = _imported(tmp_path, "no-such-command")
    assert proc.returncode == 2
    assert "No such command 'no-such-command'" in proc.stderr
    assert not {m for m in modules if m.startswith("tether.cli.")} - {
        "tether.cli.common", "tether.cli.basics", "tether.cli.lazy", "tether.cli.views", "tether.cli.views.rich_help",
        "tether.cli.views.safe_text"}


# In a fresh interpreter: typer.rich_utils imported through the stand-ins, then each one used as typer uses it.
_STAND_INS = """
import json, sys
from tether.cli.views.rich_help import load_rich_utils
load_rich_utils()
before = sorted(m for m in ("rich.markdown", "rich.traceback") if m in sys.modules)
from typer import rich_utils
from typer.models import DeveloperExceptionConfig
markdown = rich_utils.Markdown("**bold**", style="dim")  # what typer makes of help in markdown mode
try:
    raise ValueError("boom")
except ValueError as exc:
    traceback = rich_utils.get_traceback(exc, DeveloperExceptionConfig(), [])
import rich.markdown, rich.traceback
print(json.dumps({"before": before, "markdown": type(markdown) is rich.markdown.Markdown,
                  "traceback": type(traceback) is rich.traceback.Traceback,
                  "real_modules": hasattr(rich.markdown, "MarkdownIt") and hasattr(rich.traceback, "install")}))
"""


def test_the_stand_ins_for_markdown_and_traceback_become_the_real_classes_when_used(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", _STAND_INS], env=tether_env(tmp_path), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"before": [], "markdown": True, "traceback": True, "real_modules": True}


def test_a_working_sandbox_probe_is_remembered_for_this_boot(tmp_path: Path) -> None:
    from tether.sandbox.detect import CACHE_FILE, detect

    first = detect(tmp_path)
    assert first.available, f"this test needs a working bubblewrap (apt-get install bubblewrap): {first.detail}"
    cache = tmp_path / CACHE_FILE
    data = json.loads(cache.read_text())
    assert data["info"]["kind"] == first.kind and cache.stat().st_mode & 0o077 == 0
    data["info"]["detail"] = "what the file says"  # read back without a probe: the file's words come back
    cache.write_text(json.dumps(data))
    assert detect(tmp_path).detail == "what the file says"
    assert detect().detail == first.detail  # no cache directory: always the probe
    data["key"]["boot"] = "another boot"  # another boot (kernel, bwrap, sysctls, ...): probed again
    cache.write_text(json.dumps(data))
    assert detect(tmp_path) == first
    assert json.loads(cache.read_text())["key"]["boot"] != "another boot"
    cache.write_text('{"key": ')  # a torn or foreign file: probed again, no error
    assert detect(tmp_path) == first


def test_a_failed_sandbox_probe_is_not_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.sandbox.detect import CACHE_FILE, detect

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "bwrap").write_text("#!/bin/sh\necho 'bwrap: no user namespaces here' >&2\nexit 1\n")
    (fake / "bwrap").chmod(0o755)
    state = tmp_path / "state"
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")  # a real bwrap that cannot confine
    info = detect(state)
    assert not info.available and "no user namespaces here" in info.detail
    assert not (state / CACHE_FILE).exists()  # a machine that gets fixed is seen fixed at its next start
    monkeypatch.undo()
    assert detect(state).available and (state / CACHE_FILE).exists()


# ---------------------------------------------------------------- a device registers before its MCP servers

GATED = Path(__file__).resolve().parent.parent / "servers" / "gated.py"


def _gated_servers(gate: Path) -> dict[str, Any]:
    return {"gated": {"command": sys.executable, "args": [str(GATED), "--gate", str(gate)],
                      "toolType": "data_collection"}}


def _open_gate(gate: Path) -> None:
    with open(gate, "w") as fifo:  # returns once the server has opened it to read (it waits for this)
        fifo.write("go\n")


def _release(gate: Path) -> None:
    """Whatever happened, nobody stays blocked on the FIFO: a server waiting to read it gets end-of-file."""
    with contextlib.suppress(OSError):
        os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
    with contextlib.suppress(OSError):
        os.close(os.open(gate, os.O_RDONLY | os.O_NONBLOCK))


async def test_external_servers_join_a_ready_computer_as_a_waiting_one_has_them(tmp_path: Path) -> None:
    from tether.device.config import parse_device_config
    from tether.device.local import build_device
    from tether.protocol.models import Command
    from tether.tools.policy.model import Policy

    gate = tmp_path / "gate"
    os.mkfifo(gate)
    config = parse_device_config({"mcpServers": _gated_servers(gate)})
    changed: list[Any] = []
    device = build_device(config, policy=Policy(), state_dir=tmp_path / "state", sandbox=False, join_external=True,
                          on_tools_changed=changed.append)
    loop = asyncio.get_running_loop()
    try:
        computer = await device.computer_manager.get_or_create(None)  # returns while gated waits on its gate
        names = {(i.namespace, i.name) for i in computer.tool_infos()}
        assert ("shell", "shell.run") in names and not {ns for ns, _ in names} & {"gated"}
        assert computer.still_starting == ["gated"] and changed == []
        with pytest.raises(ValueError, match="still starting: gated"):  # its deadline has passed: no wait
            await computer.command2tool_when_joined(Command(tool_name="echo"), loop.time())
        await asyncio.wait_for(asyncio.to_thread(_open_gate, gate), 60)
        assert await computer.wait_for_joins(loop.time() + 60)
        assert changed == [computer] and computer.still_starting == [] and "gated" not in computer.startup_errors
        assert ("gated", "echo") in {(i.namespace, i.name) for i in computer.tool_infos()}
        # the built-in set keeps the plain name, as when the device waits for every server
        shadowed = {"tool": "read_file", "tool_type": "data_collection", "kept": "files", "shadowed": "gated",
                    "use": "gated/read_file"}
        assert computer.collisions == [shadowed]
        [echo, read] = await device.dispatcher().execute_commands(
            [Command(tool_name="echo", parameters={"text": "hi"}),
             Command(tool_name="gated/read_file", parameters={"file_path": "/x"})], timeout=60)
        assert echo.ok and "hi" in json.dumps(echo.result), echo.error
        assert read.ok and "gated would read /x" in json.dumps(read.result), read.error
    finally:
        _release(gate)
        await device.aclose()


def _stored_tools(cluster: Any, name: str) -> set[str]:
    """The device's tools as its last profile says (not asked live): what DEVICE_INFO brought."""
    import httpx

    response = httpx.get(f"http://127.0.0.1:{cluster.port}/api/v1/devices/{name}/tools", params={"live": "false"},
                         headers={"Authorization": f"Bearer {cluster.api_token}"}, timeout=10)
    response.raise_for_status()
    return {tool["name"] for tool in response.json()}


def test_tether_device_registers_first_and_its_external_server_joins_later(tmp_path: Path) -> None:
    from tests.kits.netutil import Cluster, wait_for
    from tether.protocol.models import Command, ResultStatus

    gate = tmp_path / "gate"
    os.mkfifo(gate)
    config = tmp_path / "device.yaml"
    config.write_text(json.dumps({"mcpServers": {**_gated_servers(gate),
                                                 "broken": {"command": str(tmp_path / "no-such-server")}}}))
    cluster = Cluster(tmp_path)
    try:
        device = cluster.device("alpha", extra=("--config", str(config)))
        cluster.wait_online("alpha", device)  # registered while gated cannot have answered a single frame
        assert "shell.run" in _stored_tools(cluster, "alpha") and "echo" not in _stored_tools(cluster, "alpha")
        events: list[str] = []

        def on_event(event: Any) -> None:  # the device waits for gated: now it may start
            events.append(event.kind)
            if event.kind == "starting":
                assert event.data["servers"] == ["gated"] or set(event.data["servers"]) == {"gated", "broken"}
                _open_gate(gate)

        _, [echo] = cluster.remote.run("alpha", [Command(tool_name="echo", parameters={"text": "hi"})], timeout=60,
                                       on_event=on_event)
        assert "starting" in events
        assert echo.status is ResultStatus.SUCCESS and "hi" in json.dumps(echo.result), echo.error
        wait_for(lambda: "echo" in _stored_tools(cluster, "alpha"), "the profile with gated's tools",
                 procs=(device.popen,))
        _, [bad] = cluster.remote.run("alpha", [Command(tool_name="nothing_here")], timeout=30)
        assert bad.status is ResultStatus.FAILURE and "unknown tool 'nothing_here'" in (bad.error or "")
        assert "still starting" not in (bad.error or "")  # broken failed to start: nothing is left starting
        assert cluster.status("alpha") in ("online", "busy")
    finally:
        _release(gate)
        cluster.close()


def test_a_device_with_only_built_in_tools_never_imports_the_mcp_sdk(tmp_path: Path) -> None:
    """Also (issue 33): the collector's young threshold is raised while the device starts, its start-up frozen at
    the registration and the thresholds put back as they were, all before it says it is registered."""
    from tests.kits.netutil import Cluster, wait_for
    from tether.cli.commands.setup.device_run import START_UP_GC_THRESHOLD
    from tether.protocol.models import Command

    cluster = Cluster(tmp_path)
    out = tmp_path / "modules.json"
    log = (tmp_path / "device.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-c", _GC_HARNESS, str(out), "device", "--server",
                             f"ws://127.0.0.1:{cluster.port}", "--name", "alpha", "--state-dir",
                             str(tmp_path / "dev")], stdout=log, stderr=subprocess.STDOUT,
                            env={**cluster.env, "TETHER_DEVICE_TOKEN": cluster.device_tokens["alpha"]})
    try:
        wait_for(lambda: cluster.status("alpha") in ("online", "busy"), "alpha online", 60, (proc,))
        [result] = cluster.remote.run("alpha", [Command(tool_name="get_system_info",
                                                        parameters={"info_type": "os"})], timeout=30)[1]
        assert result.ok, result.error
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        cluster.close()
    output = (tmp_path / "device.log").read_text()
    assert proc.returncode == 0, output
    modules = set(json.loads(out.read_text()))
    assert not _top(modules) & {*HEAVY, "mcp_types", "httpx"}, sorted(_top(modules) & {*HEAVY, "mcp_types", "httpx"})
    lines = output.splitlines()
    registered = next(i for i, line in enumerate(lines) if "registered as alpha; serving commands" in line)
    gc_lines = [line.split() for line in lines[:registered] if line.startswith("gc-")]
    start = [int(n) for n in gc_lines[0][1:]]
    assert gc_lines == [["gc-start", *map(str, start)],
                        ["gc-threshold", str(max(START_UP_GC_THRESHOLD, start[0])), *map(str, start[1:])],
                        ["gc-freeze"], ["gc-threshold", *map(str, start)]], output
    assert not any(line.startswith("gc-threshold") for line in lines[registered:]), output  # nothing left to undo


async def test_a_command_waits_only_for_the_server_that_has_its_tool(tmp_path: Path) -> None:
    from tether.device.config import parse_device_config
    from tether.device.local import build_device
    from tether.protocol.models import Command
    from tether.tools.policy.model import Policy

    first, second = tmp_path / "first", tmp_path / "second"
    os.mkfifo(first)
    os.mkfifo(second)
    servers = {**_gated_servers(first), "later": {**_gated_servers(second)["gated"]}}
    device = build_device(parse_device_config({"mcpServers": servers}), policy=Policy(),
                          state_dir=tmp_path / "state", sandbox=False, join_external=True)
    loop = asyncio.get_running_loop()
    try:
        computer = await device.computer_manager.get_or_create(None)
        assert computer.still_starting == ["gated", "later"]
        opened = asyncio.ensure_future(asyncio.to_thread(_open_gate, second))  # only the second one starts
        call = await computer.command2tool_when_joined(Command(tool_name="later/echo"), loop.time() + 60)
        assert call.tool_key == "data_collection::later/echo" and computer.still_starting == ["gated"]
        await asyncio.wait_for(opened, 60)
    finally:
        _release(first)
        _release(second)
        await device.aclose()
    assert computer.still_starting == []


async def test_a_profile_change_while_registering_is_sent_once_registered(tmp_path: Path) -> None:
    from tests.device.test_connection import TOKEN, ScriptedServer
    from tether.device.link.connection import DeviceConnection
    from tether.device.local import build_device
    from tether.protocol.messages import ClientMessageType
    from tether.protocol.profile import DeviceProfile
    from tether.tools.policy.model import Policy

    device = build_device(policy=Policy(), state_dir=tmp_path / "state", sandbox=False)
    collected: list[int] = []
    connections: list[DeviceConnection] = []

    async def profile() -> DeviceProfile:
        collected.append(len(collected) + 1)
        if len(collected) == 1:  # an external server joins while the registration's profile is collected
            connections[0].profile_changed()
        return DeviceProfile(tags=[f"v{len(collected)}"])

    async with ScriptedServer() as server:
        conn = DeviceConnection(device.client, server.url, TOKEN, name="dev-1", profile=profile)
        connections.append(conn)
        task = asyncio.create_task(conn.run())
        try:
            async with asyncio.timeout(15):
                registration = await server.registrations.get()
            assert registration.profile.tags == ["v1"]
            info = await server.next(ClientMessageType.DEVICE_INFO)  # unasked: the change was not in v1
            assert info.prev_response_id is None and (info.payload or {})["tags"] == ["v2"]
            conn.profile_changed()  # registered: sent at once
            info = await server.next(ClientMessageType.DEVICE_INFO)
            assert (info.payload or {})["tags"] == ["v3"] and collected == [1, 2, 3]
        finally:
            conn.stop()
            async with asyncio.timeout(15):
                await asyncio.gather(task, return_exceptions=True)
            await device.aclose()


# What `tether server` imports before it serves: the agent app built, as `tether server` builds it.
_SERVER_APP = """
import json, sys
from tether.agent.llm.settings import resolve_llm_settings
from tether.agent.server_app import create_agent_app
from tether.server.main import run_server
from tether.server.settings import ServerSettings
create_agent_app(ServerSettings(db_path=sys.argv[1]), llm_settings=resolve_llm_settings())
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def test_the_server_app_is_built_without_the_mcp_sdk_jsonschema_or_yaml(tmp_path: Path) -> None:
    """/mcp is built on its first request (server/mcp/lazy_gateway.py); plans' argument checks import
    jsonschema and a config file yaml when they are used: none of them is needed to answer /health."""
    env = {key: value for key, value in tether_env(tmp_path).items()
           if not key.startswith("TETHER_LLM_") and key != "TETHER_CONFIG"}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "no-config")
    proc = subprocess.run([sys.executable, "-c", _SERVER_APP, str(tmp_path / "server.db")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout))
    assert "fastapi" in loaded, "the harness built the app"
    assert not loaded & {"mcp", "mcp_types", "jsonschema", "yaml", "openai", "playwright", "jwt"}, sorted(loaded)
