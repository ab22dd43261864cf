"""Issue 26, item 3: no IPC out of the sandbox. A sandboxed command — whatever program the policy lets it
run — cannot reach a unix socket on the machine (a tmux server that would open a window outside the
sandbox, a session bus, an HTTP API on a unix socket, an abstract socket), nor signal a process outside,
unless the policy names that socket in `allow_sockets`; and a socket it names does not open the others.

Every server here is real and runs outside the sandbox, started by the test as the device's user.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.kits.confined_device import (  # noqa: F401 (fixtures)
    SYSTEM_PYTHON,
    Attacker,
    attacker_factory,
    home,
    outside,
    require,
    stdout,
    text,
)
from tether.protocol.models import ResultStatus

REFUSED = ("Operation not permitted", "Connection refused", "not permitted")


def _refused(output: str) -> bool:
    return any(word in output for word in REFUSED)


# ------------------------------------------------------------------------------------ the machine's servers


@pytest.fixture
def tmux_server(outside: Path) -> Iterator[Path]:  # noqa: F811
    """The device user's tmux server: a window it opens runs outside any sandbox."""
    tmux = require("tmux", "tmux")
    sock = outside / "tmux.sock"
    subprocess.run([tmux, "-S", str(sock), "-f", "/dev/null", "new-session", "-d", "-s", "victim", "sleep 600"],
                   check=True, timeout=30)
    yield sock
    subprocess.run([tmux, "-S", str(sock), "kill-server"], timeout=30, check=False)


def _windows(sock: Path) -> list[str]:
    done = subprocess.run(["tmux", "-S", str(sock), "list-windows", "-a", "-F", "#W"], capture_output=True,
                          text=True, timeout=30, check=True)
    return done.stdout.split()


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A one-request HTTP server's handler: says who it is (a Docker-like API on a unix socket)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        body = b"host-api: you reached the machine"
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
    writer.close()


@pytest.fixture
async def http_socket(outside: Path) -> AsyncIterator[Path]:  # noqa: F811
    path = outside / "api.sock"
    server = await asyncio.start_unix_server(_answer, path=str(path))
    yield path
    server.close()


@pytest.fixture
async def abstract_socket() -> AsyncIterator[str]:
    name = f"tether-attack-{secrets.token_hex(6)}"
    server = await asyncio.start_unix_server(_answer, path="\0" + name)
    yield name
    server.close()


@pytest.fixture
def session_bus(outside: Path) -> Iterator[str]:  # noqa: F811
    daemon = require("dbus-daemon", "dbus")
    require("dbus-send", "dbus")
    address = f"unix:path={outside / 'bus'}"
    proc = subprocess.Popen([daemon, "--session", "--nofork", f"--address={address}", "--print-address=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    printed = proc.stdout.readline()  # printed once the bus listens
    assert printed.startswith("unix:"), (printed, proc.stderr.read() if proc.poll() is not None else "")
    yield address
    proc.kill()
    proc.wait(timeout=30)


# ------------------------------------------------------------------------------------ nothing named: nothing out


async def test_a_tmux_server_on_the_machine_opens_no_window_for_a_sandboxed_command(
        attacker_factory, tmux_server: Path) -> None:  # noqa: F811
    attacker: Attacker = await attacker_factory(commands={"tmux": {}}, allow_escapes=["interactive"])
    before = _windows(tmux_server)
    result = await attacker.run("tmux", "-S", str(tmux_server), "new-window", "-d", "-n", "pwned", "sleep 600")
    assert result.status is ResultStatus.FAILURE, text(result)
    assert _refused(text(result)), text(result)
    assert _windows(tmux_server) == before  # no window, no command outside the sandbox


async def test_a_unix_socket_http_api_and_an_abstract_socket_are_unreachable(
        attacker_factory, http_socket: Path, abstract_socket: str) -> None:  # noqa: F811
    require("curl", "curl")
    attacker: Attacker = await attacker_factory(commands={"curl": {}})  # network on: the host's abstract sockets
    by_path = await attacker.run("curl", "-sS", "--max-time", "10", "--unix-socket", str(http_socket), "http://x/")
    by_name = await attacker.run("curl", "-sS", "--max-time", "10", "--abstract-unix-socket", abstract_socket,
                                 "http://x/")
    for result in (by_path, by_name):
        assert result.status is ResultStatus.FAILURE, text(result)
        assert "you reached the machine" not in stdout(result)
        assert "Operation not permitted" in text(result) or "Couldn't connect" in text(result), text(result)


async def test_the_session_bus_is_unreachable(attacker_factory, session_bus: str) -> None:  # noqa: F811
    attacker: Attacker = await attacker_factory(commands={"dbus-send": {}})
    result = await attacker.run("dbus-send", f"--bus={session_bus}", "--print-reply", "--dest=org.freedesktop.DBus",
                                "/org/freedesktop/DBus", "org.freedesktop.DBus.ListNames")
    assert result.status is ResultStatus.FAILURE, text(result)
    assert "org.freedesktop.DBus" not in stdout(result)


async def test_interpreted_code_gets_no_unix_socket_no_odd_family_and_no_io_uring(
        attacker_factory, http_socket: Path) -> None:  # noqa: F811
    attacker: Attacker = await attacker_factory(allow_inline_code=True)
    result = await attacker.python("""
import ctypes, errno, socket
def attempt(*args):
    try:
        s = socket.socket(*args)
    except OSError as e:
        return errno.errorcode[e.errno]
    s.close()
    return "made"
print("unix", attempt(socket.AF_UNIX, socket.SOCK_STREAM))
print("unix-dgram", attempt(socket.AF_UNIX, socket.SOCK_DGRAM))
print("vsock", attempt(40, socket.SOCK_STREAM))  # a VM's host, whatever the network namespace says
print("sock_diag", attempt(socket.AF_NETLINK, socket.SOCK_RAW, 4))  # would list the machine's sockets
print("packet", attempt(17, socket.SOCK_RAW))
print("inet", attempt(socket.AF_INET, socket.SOCK_STREAM))
a, b = socket.socketpair()  # a program's own pipes stay
a.send(b"x"); print("pair", b.recv(1).decode())
libc = ctypes.CDLL(None, use_errno=True)
params = (ctypes.c_byte * 120)()
print("io_uring", libc.syscall(425, 8, params), errno.errorcode[ctypes.get_errno()])
""")
    assert result.ok, text(result)
    lines = dict(line.split(" ", 1) for line in stdout(result).splitlines())
    assert lines == {"unix": "EPERM", "unix-dgram": "EPERM", "vsock": "EAFNOSUPPORT", "sock_diag": "EAFNOSUPPORT",
                     "packet": "EAFNOSUPPORT", "inet": "made", "pair": "x", "io_uring": "-1 ENOSYS"}, lines


async def test_no_signal_reaches_a_process_outside(attacker_factory) -> None:  # noqa: F811
    victim = subprocess.Popen(["sleep", "600"])
    try:
        attacker: Attacker = await attacker_factory(commands={"kill": {}})
        result = await attacker.run("kill", "-KILL", str(victim.pid))
        assert result.status is ResultStatus.FAILURE, text(result)
        assert victim.poll() is None, "a sandboxed command killed a process outside the sandbox"
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)


# ------------------------------------------------------------------------------------ named: that one only


async def test_a_named_socket_is_reachable_and_the_others_stay_closed(
        attacker_factory, tmux_server: Path, http_socket: Path, abstract_socket: str) -> None:  # noqa: F811
    require("curl", "curl")
    attacker: Attacker = await attacker_factory(commands={"curl": {}, "tmux": {}}, allow_escapes=["interactive"],
                                                allow_sockets=[str(http_socket)])
    named = await attacker.run("curl", "-sS", "--max-time", "10", "--unix-socket", str(http_socket), "http://x/")
    assert named.ok and "you reached the machine" in stdout(named), text(named)
    # AF_UNIX is allowed now; the machine's other sockets are masked, abstract ones scoped away by Landlock
    other = await attacker.run("tmux", "-S", str(tmux_server), "new-window", "-d", "-n", "pwned", "sleep 600")
    assert other.status is ResultStatus.FAILURE and "pwned" not in _windows(tmux_server), text(other)
    abstract = await attacker.run("curl", "-sS", "--max-time", "10", "--abstract-unix-socket", abstract_socket,
                                  "http://x/")
    assert abstract.status is ResultStatus.FAILURE and "you reached" not in stdout(abstract), text(abstract)


async def test_sandbox_allows_a_program_s_own_sockets_and_none_of_the_machine_s(
        attacker_factory, http_socket: Path, abstract_socket: str) -> None:  # noqa: F811
    """`allow_sockets: [sandbox]`: a program that talks to itself over a unix socket it binds (Python's
    multiprocessing managers, build daemons) works; the machine's sockets stay closed."""
    attacker: Attacker = await attacker_factory(allow_inline_code=True, allow_sockets=["sandbox"])
    result = await attacker.python(f"""
import errno, os, socket, tempfile
own = os.path.join(tempfile.mkdtemp(), "own.sock")
server = socket.socket(socket.AF_UNIX)
server.bind(own)
server.listen()
client = socket.socket(socket.AF_UNIX)
client.connect(own)
conn, _ = server.accept()
client.send(b"hi")
print("own", conn.recv(2).decode())
for name, address in (("machine", {str(http_socket)!r}), ("abstract", "\\0" + {abstract_socket!r})):
    try:
        socket.socket(socket.AF_UNIX).connect(address)
        print(name, "reached")
    except OSError as e:
        print(name, errno.errorcode[e.errno])
""")
    assert result.ok, text(result)
    assert stdout(result).split("\n")[:3] == ["own hi", "machine ECONNREFUSED", "abstract EPERM"], text(result)


async def test_a_named_tmux_socket_works_as_asked(attacker_factory, tmux_server: Path) -> None:  # noqa: F811
    attacker: Attacker = await attacker_factory(commands={"tmux": {}}, allow_escapes=["interactive"],
                                                allow_sockets=[str(tmux_server)])
    result = await attacker.run("tmux", "-S", str(tmux_server), "new-window", "-d", "-n", "asked", "sleep 600")
    assert result.ok, text(result)
    assert "asked" in _windows(tmux_server)


async def test_a_named_session_bus_answers(attacker_factory, session_bus: str) -> None:  # noqa: F811
    attacker: Attacker = await attacker_factory(commands={"dbus-send": {}},
                                                allow_sockets=[session_bus.removeprefix("unix:path=")])
    result = await attacker.run("dbus-send", f"--bus={session_bus}", "--print-reply", "--dest=org.freedesktop.DBus",
                                "/org/freedesktop/DBus", "org.freedesktop.DBus.ListNames")
    assert result.ok and "org.freedesktop.DBus" in stdout(result), text(result)


def test_python_is_the_system_one() -> None:
    assert os.access(SYSTEM_PYTHON, os.X_OK), f"{SYSTEM_PYTHON} is missing; install it with: apt-get install -y python3"


# ------------------------------------------------------------------------------------ live processes


async def test_a_live_process_gets_the_same_filter(tmp_path: Path, http_socket: Path) -> None:
    """A stdio MCP server or launched application runs under bwrap directly (no warden): the same filter,
    and with a socket named, the machine's others masked."""
    from tether.sandbox import SandboxSpec, detect
    from tether.sandbox.confine.bwrap import live_argv

    info = detect()
    assert info.available and info.bwrap, info.detail
    other = tmp_path / "other.sock"
    server = await asyncio.start_unix_server(_answer, path=str(other))
    code = f"""
import errno, socket
for path in ({str(http_socket)!r}, {str(other)!r}):
    try:
        socket.socket(socket.AF_UNIX).connect(path)
        print('reached', end=' ')
    except OSError as e:
        print(errno.errorcode[e.errno], end=' ')
"""
    try:
        for allowed, expected in (((), "EPERM EPERM"), ((str(http_socket),), "reached ECONNREFUSED")):
            spec = SandboxSpec.build(write_roots=[str(tmp_path)], layers_dir=str(tmp_path / "layers"),
                                     allow_sockets=list(allowed))
            argv = live_argv(spec, [SYSTEM_PYTHON, "-c", code], bwrap=info.bwrap)
            proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert out.decode().strip() == expected, (allowed, out, err)
    finally:
        server.close()


async def test_a_socket_in_another_users_private_directory_neither_breaks_nor_opens_the_sandbox(
        tmp_path: Path, http_socket: Path) -> None:
    """A socket the sandbox cannot even look up (PostgreSQL's in its 0700 directory, /run/user/N/bus) gets
    no mask bwrap could not mount (it failed to start: "Can't mkdir parents", seen when another test's
    PostgreSQL ran at the same time), and the command still cannot reach it."""
    import pwd
    import tempfile

    from tether.sandbox import SandboxSpec, detect
    from tether.sandbox.confine.bwrap import live_argv

    if os.geteuid() != 0:
        pytest.fail("this test makes a directory of another user: run it as root (CI does)")
    info = detect()
    assert info.available and info.bwrap, info.detail
    private = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-private-"))
    foreign = private / "run.sock"
    server = await asyncio.start_unix_server(_answer, path=str(foreign))
    nobody = pwd.getpwnam("nobody")
    os.chown(private, nobody.pw_uid, nobody.pw_gid)
    private.chmod(0o700)
    code = f"""
import errno, socket
try:
    socket.socket(socket.AF_UNIX).connect({str(foreign)!r})
    print('reached')
except OSError as e:
    print(errno.errorcode[e.errno])
"""
    try:
        spec = SandboxSpec.build(write_roots=[str(tmp_path)], layers_dir=str(tmp_path / "layers"),
                                 allow_sockets=[str(http_socket)])
        proc = await asyncio.create_subprocess_exec(*live_argv(spec, [SYSTEM_PYTHON, "-c", code], bwrap=info.bwrap),
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0 and out.decode().strip() == "EACCES", (out, err)
    finally:
        server.close()
        os.chown(private, 0, 0)
        foreign.unlink(missing_ok=True)
        private.rmdir()
