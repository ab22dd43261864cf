"""Issue 26, the gaps the first containment round left, tried as an attacker (or a careless server) would.

1. A server pushes `network`: it can narrow a device's network (off, or a shorter host list) and the
   running device follows at once, but nothing it pushes widens what the device's own policy allows.
2. A sandboxed stdio MCP server, on a device whose policy lists hosts, reaches the listed ones through
   the egress proxy and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kits.confined_device import attacker_factory, home, stdout, text  # noqa: F401 (fixtures)
from tests.kits.netutil import CLI, Cluster
from tests.kits.upstream import upstream
from tether.sandbox import SandboxSpec, detect
from tether.sandbox.egress.proxy import EgressRecord
from tether.sandbox.egress.rules import EgressRules
from tether.sandbox.runner import Sandbox

BODY = b"upstream says hello\n"


def _require(program: str, install: str) -> str:
    path = shutil.which(program)
    if path is None:
        pytest.fail(f"{program} is not installed; install it with: {install}")
    return os.path.realpath(path)


@pytest.fixture
def upstreams() -> Iterator[tuple[int, int]]:
    """Two HTTP servers on 127.0.0.1 (threads: the processes under test are others), their ports."""
    with upstream(BODY) as first, upstream(BODY) as second:
        yield first, second


# ---------------------------------------------------------------- 1. network pushed from the server


def test_a_server_narrows_a_devices_host_list_and_cannot_widen_it(tmp_path: Path, upstreams: tuple[int, int]) -> None:
    curl = _require("curl", "apt-get install -y curl")
    kept, dropped = upstreams
    policy = tmp_path / "policy.yaml"
    policy.write_text(json.dumps({"commands": {"curl": {}},
                                  "network": {"allow": [f"localhost:{kept}", f"localhost:{dropped}"]},
                                  # the commands' cwd: a root of its own (each call's /tmp is private)
                                  "write_roots": ["~", tempfile.gettempdir(), str(tmp_path)]}))
    cluster = Cluster(tmp_path)
    env = {**cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{cluster.port}", "TETHER_TOKEN": cluster.api_token}

    def tether(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=120,
                              stdin=subprocess.DEVNULL)

    def fetch(port: int) -> str:
        done = tether("exec", "--device", "alpha", "shell.run", f"cmd={curl}",
                      f"argv={json.dumps(['-sS', f'http://localhost:{port}/'])}", f"cwd={tmp_path}")
        return done.stdout + done.stderr

    def push(value: Any) -> subprocess.CompletedProcess[str]:
        change = tmp_path / "change.yaml"
        change.write_text(json.dumps({"network": value}))
        return tether("policy", "set", "--device", "alpha", "--file", str(change))

    try:
        alpha = cluster.device("alpha", extra=("--policy", str(policy)))
        cluster.wait_online("alpha", alpha)
        assert BODY.decode() in fetch(dropped)

        narrowed = push({"allow": [f"localhost:{kept}", "example.org"]})
        assert narrowed.returncode == 0, narrowed.stdout + narrowed.stderr
        assert BODY.decode() in fetch(kept)
        refused = fetch(dropped)  # at once, on the running device: the proxy judges by the new rules
        assert "network.not-allowed" in refused and BODY.decode() not in refused
        shown = json.loads(tether("policy", "show", "--device", "alpha", "--json").stdout)
        assert shown["policy"]["network"]["allow"] == [f"localhost:{kept}"]  # example.org: not the device's
        assert shown["sources"]["network"] == "remote"

        widen = push("on")  # a server that tries to lift the list is told why not, and nothing changes
        assert widen.returncode == 1 and "would widen this device's own host list" in widen.stderr
        assert "Traceback" not in widen.stderr
        assert "network.not-allowed" in fetch(dropped)

        assert push("off").returncode == 0
        assert "network.not-allowed" in fetch(kept)

        alpha.stop()  # restarted, the device starts from the narrowed network
        alpha = cluster.device("alpha", extra=("--policy", str(policy)))
        cluster.wait_online("alpha", alpha)
        assert "network.not-allowed" in fetch(kept)
    finally:
        cluster.close()


async def _fetch(sandbox: Sandbox, port: int, *, direct: bool) -> str:
    """A Python client in the sandbox: straight to 127.0.0.1:port, or to localhost through $HTTP_PROXY."""
    code = (f"import urllib.request as u\nh = u.ProxyHandler({{}}) if {direct} else u.ProxyHandler()\n"
            f"url = 'http://{'127.0.0.1' if direct else 'localhost'}:{port}/'\n"
            "try:\n    print(u.build_opener(h).open(url, timeout=10).read().decode(), end='')\n"
            "except Exception as exc:\n    print('failed', exc)\n")
    python = os.path.realpath(sys.executable)
    proc = await sandbox.spawn([python, "-I", "-c", code], executable=python, cwd="/",
                               env={"PATH": "/usr/bin:/bin"}, stdin=False, layer=None)
    assert proc.stdout is not None and proc.stderr is not None
    async with asyncio.timeout(30):
        out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
        await proc.wait()
    return out.decode() + err.decode()


@pytest.fixture
async def open_box(tmp_path: Path) -> AsyncIterator[tuple[Sandbox, list[EgressRecord]]]:
    info = detect()
    if not info.available:
        pytest.fail(f"these tests need bubblewrap (apt-get install -y bubblewrap): {info.detail}")
    (tmp_path / "root").mkdir()
    spec = SandboxSpec.build(write_roots=[str(tmp_path / "root")], network=True, layers_dir=str(tmp_path / "layers"))
    audited: list[EgressRecord] = []
    sandbox = Sandbox(info, spec, audit=lambda r, e: e == "open" and audited.append(r))  # type: ignore[func-returns-value]
    try:
        yield sandbox, audited
    finally:
        await sandbox.aclose()


async def test_a_device_on_the_open_network_narrowed_to_a_list_loses_its_direct_network(
        open_box: tuple[Sandbox, list[EgressRecord]], upstreams: tuple[int, int]) -> None:
    sandbox, audited = open_box
    kept, dropped = upstreams
    assert await _fetch(sandbox, dropped, direct=True) == BODY.decode()  # the device's own `network: on`

    sandbox.renetwork(False, EgressRules.build(allow=[f"localhost:{kept}"]))  # the server's list
    assert "failed" in await _fetch(sandbox, dropped, direct=True)  # a new namespace: no route at all
    assert await _fetch(sandbox, kept, direct=False) == BODY.decode()
    assert "403" in await _fetch(sandbox, dropped, direct=False)
    assert [(r.port, r.allowed, r.rule) for r in audited] == [
        (kept, True, f"network.allow: localhost:{kept}"), (dropped, False, "network.not-allowed")]

    sandbox.renetwork(True, None)  # the server's change withdrawn: the device's own again
    assert await _fetch(sandbox, dropped, direct=True) == BODY.decode()


# ---------------------------------------------------------------- 2. sandboxed stdio MCP servers get the proxy

FETCHER = str(Path(__file__).resolve().parent.parent / "servers" / "fetcher.py")


def _said(result: Any) -> str:
    return (result.error or "") + "\n" + json.dumps(result.result)


async def test_a_sandboxed_mcp_server_reaches_listed_hosts_through_the_proxy_and_nothing_else(
        home: Path, upstreams: tuple[int, int]) -> None:  # noqa: F811 (the fixture)
    from tether.device.config import parse_device_config
    from tether.device.local import build_device
    from tether.protocol.models import Command, ResultStatus
    from tether.tools.policy.model import policy_from_mapping

    listed, unlisted = upstreams
    config = parse_device_config({"mcpServers": {"net": {
        "command": sys.executable, "args": [FETCHER], "sandbox": True, "autoApprove": ["fetch", "proxy"]}}})
    policy = policy_from_mapping({"network": {"allow": [f"localhost:{listed}"], "deny": ["*.evil.test"]}})
    state = home / ".local/state/tether"
    state.mkdir(parents=True)
    device = build_device(config, policy=policy, state_dir=state, sandbox=True)
    sandbox = device.context.sandbox
    assert sandbox is not None and sandbox.egress is not None, "no sandbox was made here (see the log for why)"
    seen: list[EgressRecord] = []
    audit = sandbox.egress.audit

    def watch(record: EgressRecord, event: str) -> None:
        if event == "open":
            seen.append(record)
        if audit is not None:
            audit(record, event)

    sandbox.egress.audit = watch

    async def fetch(url: str) -> Any:
        [result] = await device.client.execute_actions([Command(tool_name="net/fetch", parameters={"url": url})])
        return result

    try:
        computer = await device.computer_manager.get_or_create(None)
        assert "net" not in computer.startup_errors, computer.startup_errors
        async with asyncio.timeout(60):
            ok = await fetch(f"http://localhost:{listed}/")
            assert ok.status is ResultStatus.SUCCESS and ok.result["text"] == BODY.decode(), _said(ok)
            unlisted_host = await fetch(f"http://localhost:{unlisted}/")
            denied = await fetch("http://www.evil.test/")
            direct = await fetch(f"http://127.0.0.1:{listed}/")  # an address is judged as written: unlisted
            [env] = await device.client.execute_actions([Command(tool_name="net/proxy", parameters={})])
    finally:
        await device.aclose()
    assert unlisted_host.status is ResultStatus.FAILURE and "network.not-allowed" in _said(unlisted_host)
    assert denied.status is ResultStatus.FAILURE and "network.deny: *.evil.test" in _said(denied)
    assert direct.status is ResultStatus.FAILURE and "network.not-allowed" in _said(direct)
    assert "HTTP_PROXY=http://127.0.0.1:" in _said(env) and "ALL_PROXY=socks5h://127.0.0.1:" in _said(env)
    assert [(r.host, r.port, r.allowed) for r in seen] == [
        ("localhost", listed, True), ("localhost", unlisted, False), ("www.evil.test", 80, False),
        ("127.0.0.1", listed, False)]


# ---------------------------------------------------------------- 3. launch_application reaches its X display


@pytest.fixture
def xvfb(tmp_path: Path) -> Iterator[str]:
    from tests.kits.desktop import running_xvfb

    for program, install in (("Xvfb", "apt-get install -y xvfb"), ("xmessage", "apt-get install -y x11-utils"),
                             ("xdpyinfo", "apt-get install -y x11-utils")):
        _require(program, install)
    with running_xvfb(tmp_path / "xvfb.log") as display:
        yield display


async def test_a_launched_gui_program_reaches_its_display_and_no_other_socket(
        home: Path, xvfb: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    import socket

    from tether.device.local import build_device
    from tether.tools.desktop.x11 import display_socket
    from tether.tools.policy.model import policy_from_mapping
    from tether.tools.system.tool import system_toolset

    monkeypatch.setenv("DISPLAY", xvfb)
    x_socket = display_socket(xvfb)
    assert x_socket == f"/tmp/.X11-unix/X{xvfb[1:]}"
    other_path = str(tmp_path / "agent.sock")  # another unix socket of the device user's (an ssh-agent, say)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(other_path)
    other.listen()
    state = home / ".local/state/tether"
    state.mkdir(parents=True)
    device = build_device(policy=policy_from_mapping({"commands": {"xmessage": {}}, "require_sandbox": True}),
                          state_dir=state, sandbox=True)
    assert device.context.sandbox is not None, "no sandbox was made here (see the log for why)"
    pid = 0
    try:
        result = await system_toolset().call("launch_application", {
            "app_name": "xmessage", "args": ["-name", "tether-gaps", "hello from the sandbox"],
            "waitForWindowMs": 15000}, device.context)
        assert result.ok, result
        pid = result.result["pid"]
        assert result.result["sandbox"] != "none" and result.result["window"] is not None, result.result

        # the same allowance, tried by a program that goes for another socket too: connect(2) with a whole
        # sockaddr_un, as libxcb does (a shorter address is refused like an abstract one: seccomp.program)
        python = os.path.realpath(sys.executable)
        probe = ("import ctypes, os, socket, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                 "for path in sys.argv[1:]:\n    s = socket.socket(socket.AF_UNIX)\n"
                 "    addr = ctypes.create_string_buffer(110)\n    addr[0:2] = (1).to_bytes(2, 'little')\n"
                 "    addr[2:2 + len(path)] = path.encode()\n"
                 "    rc = libc.connect(s.fileno(), addr, 110)\n"
                 "    print('reached' if rc == 0 else 'refused', path, ctypes.get_errno())\n"
                 "s = socket.socket(socket.AF_UNIX)\n"
                 "try:\n    s.connect(b'\\0' + sys.argv[1].encode()); print('reached abstract')\n"
                 "except OSError as exc:\n    print('refused abstract', exc.errno)\n")
        proc = await device.context.sandbox.spawn([python, "-I", "-c", probe, x_socket, other_path],
                                                  executable=python, cwd="/", env={"PATH": "/usr/bin:/bin"},
                                                  stdin=False, layer=None, display_socket=x_socket)
        assert proc.stdout is not None and proc.stderr is not None
        async with asyncio.timeout(30):
            out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
            await proc.wait()
        assert out.decode().splitlines() == [
            f"reached {x_socket} 0", f"refused {other_path} {errno.ECONNREFUSED}",
            f"refused abstract {errno.ECONNREFUSED}"], out + err
        # without the display's allowance, no unix socket at all
        proc = await device.context.sandbox.spawn([python, "-I", "-c", probe, x_socket], executable=python, cwd="/",
                                                  env={"PATH": "/usr/bin:/bin"}, stdin=False, layer=None)
        assert proc.stdout is not None and proc.stderr is not None
        async with asyncio.timeout(30):
            out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
            await proc.wait()
        assert b"PermissionError" in err and b"reached" not in out
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        other.close()
        await device.aclose()


# ---------------------------------------------------------------- 4. hidden entries are absent, not empty


async def test_hidden_entries_are_absent_from_a_commands_view_and_nothing_is_deleted(
        attacker_factory: Any, home: Path) -> None:  # noqa: F811
    from tether.protocol.models import ResultStatus

    (home / ".ssh").mkdir(mode=0o700)
    (home / ".ssh/id_rsa").write_text("PRIVATE KEY\n")
    (home / ".netrc").write_text("machine x password y\n")
    (home / ".config/gh").mkdir(parents=True)
    (home / ".config/gh/hosts.yml").write_text("token: z\n")
    (home / ".config").chmod(0o750)
    (home / "notes.txt").write_text("notes\n")
    attacker = await attacker_factory(commands={"rm": {}})
    config_before = os.stat(home / ".config")

    listing = await attacker.run("ls", "-a", str(home))
    names = stdout(listing).split()
    assert "notes.txt" in names and ".config" in names, text(listing)
    assert ".ssh" not in names and ".netrc" not in names, text(listing)
    inner = await attacker.run("ls", "-a", str(home / ".config"))
    assert "gh" not in stdout(inner).split(), text(inner)
    mode = await attacker.run("stat", "-c", "%a", str(home / ".config"))
    assert stdout(mode).strip() == "750", text(mode)  # the directory above a hidden one looks as it is
    read = await attacker.run("cat", str(home / ".ssh/id_rsa"))
    assert read.status is ResultStatus.FAILURE and "No such file or directory" in text(read)
    assert "PRIVATE KEY" not in text(read)

    # an ordinary change goes through, and the planted whiteouts are no deletions
    wrote = await attacker.run("touch", str(home / "made.txt"))
    assert wrote.ok and (home / "made.txt").exists(), text(wrote)
    assert [c["path"] for c in wrote.result["changes"]] == [str(home / "made.txt")], text(wrote)
    deleted = await attacker.run("rm", str(home / "notes.txt"))  # a real deletion is still seen (and held)
    assert [(c["path"], c["kind"]) for c in deleted.result["changes"]] == [(str(home / "notes.txt"), "deleted")]
    # a hidden path that looks absent is still uncreatable: refused, nothing applied
    planted = await attacker.run("mkdir", "-p", str(home / ".ssh/evil"))
    assert planted.status is ResultStatus.FAILURE and "hide_paths" in text(planted), text(planted)
    assert not (home / ".ssh/evil").exists()
    assert (home / ".ssh/id_rsa").read_text() == "PRIVATE KEY\n" and (home / ".netrc").exists()
    assert (home / ".config/gh/hosts.yml").exists()
    after = os.stat(home / ".config")
    assert (after.st_mode, after.st_mtime_ns) == (config_before.st_mode, config_before.st_mtime_ns)
