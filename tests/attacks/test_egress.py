"""Issue 26, item 4: a sandbox whose policy lists hosts reaches those hosts and nothing else.

Tried as a command would try it, with real sockets: an HTTP server on this machine's loopback that
the test starts, reached by name (`localhost`) through the egress proxy, over HTTP CONNECT, a plain
forward-proxy request and SOCKS5; denied and unlisted hosts; private and loopback addresses by
literal and by a name that resolves to one; a direct connection that skips the proxy; curl inside a
real bubblewrap sandbox, and a whole device running `curl` through `shell.run`. Every connection
must be audited with its rule, and every refusal must reach the caller with that rule.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tether.sandbox import SandboxSpec, detect
from tether.sandbox.egress.proxy import EgressProxy, EgressRecord, Limits
from tether.sandbox.egress.rules import EgressRules, is_public, parse_address, parse_entry
from tether.sandbox.runner import Sandbox
from tether.tools.policy.model import policy_from_mapping
from tether.tools.running.sandboxing import egress_rules, sandbox_spec

BODY = b"hello from the upstream server\n"
IO_TIMEOUT_S = 10.0


def _require(program: str, install: str) -> str:
    path = shutil.which(program)
    if path is None:
        pytest.fail(f"{program} is not installed; install it with: {install}")
    return os.path.realpath(path)


@dataclass
class Upstream:
    """A tiny HTTP server on 127.0.0.1: answers every request with BODY and counts the connections it got."""

    port: int = 0
    hits: list[str] = field(default_factory=list)
    heads: list[str] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(IO_TIMEOUT_S):
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return  # a tunnel closed without a request
                self.hits.append(head.split(b"\r\n", 1)[0].decode())
                self.heads.append(head.decode())
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                             % (len(BODY), BODY))
                await writer.drain()
        finally:
            writer.close()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    server = await asyncio.start_server(up.handle, "127.0.0.1", 0)
    up.port = server.sockets[0].getsockname()[1]
    try:
        yield up
    finally:
        server.close()


class Proxy:
    """An EgressProxy on a listening socket of the test's own, with the records it audited."""

    def __init__(self, rules: EgressRules, limits: Limits | None = None) -> None:
        self.records: list[tuple[str, EgressRecord]] = []
        self.proxy = EgressProxy(rules, audit=lambda r, e: self.records.append((e, r)), limits=limits)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.proxy.serve(self.listener)

    def closed(self) -> list[EgressRecord]:
        return [r for e, r in self.records if e == "close"]


async def _exchange(port: int, data: bytes, *, until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(IO_TIMEOUT_S):
            writer.write(data)
            await writer.drain()
            return await reader.read() if until_close else await reader.read(4096)
    finally:
        writer.close()


async def _connect_tunnel(port: int, target: str) -> tuple[bytes, bytes]:
    """CONNECT target, then (if 200) an HTTP GET through the tunnel: (the proxy's reply, what came back)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(IO_TIMEOUT_S):
            writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            reply = await reader.readuntil(b"\r\n\r\n")
            if b" 200 " not in reply.split(b"\r\n", 1)[0]:
                return reply + await reader.read(), b""
            writer.write(f"GET / HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
            return reply, await reader.read()
    finally:
        writer.close()


async def _socks(port: int, host: str | bytes, target_port: int) -> tuple[int, bytes]:
    """A SOCKS5 CONNECT by name (or a 4-byte IPv4 address): the reply code and what a GET then returns."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(IO_TIMEOUT_S):
            writer.write(b"\x05\x01\x00")
            assert await reader.readexactly(2) == b"\x05\x00"
            address = b"\x01" + host if isinstance(host, bytes) else b"\x03" + bytes([len(host)]) + host.encode()
            writer.write(b"\x05\x01\x00" + address + target_port.to_bytes(2, "big"))
            reply = await reader.readexactly(10)
            if reply[1] != 0:
                return reply[1], b""
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            return 0, await reader.read()
    finally:
        writer.close()


def _refusal(response: bytes) -> tuple[int, str, dict[str, Any]]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers["X-Tether-Rule"], json.loads(body)


# ---------------------------------------------------------------- the rules, on their own


def test_entries_parse_and_bad_ones_are_named() -> None:
    assert parse_entry("*.Example.com:443").suffix == ".example.com"
    assert parse_entry("[fd00::1]:8080").port == 8080
    assert str(parse_entry("10.0.0.0/8").network) == "10.0.0.0/8"
    for bad in ("", "a b", "host:0", "host:99999", "[::1", "10.0.0.0/99", "-bad-.com"):
        with pytest.raises(ValueError):
            parse_entry(bad)
    for special in ("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "100.64.0.1", "169.254.169.254",
                    "::1", "fd00::1", "fe80::1", "0.0.0.0", "224.0.0.1", "::ffff:127.0.0.1", "240.0.0.1"):
        address = parse_address(special)
        assert address is not None and not is_public(address), special
    public = parse_address("93.184.216.34")
    assert public is not None and is_public(public)


def test_the_policy_setting_takes_on_off_and_lists_and_round_trips() -> None:
    from tether.tools.policy.overlay import effective

    assert policy_from_mapping({"network": "off"}).network is False
    assert policy_from_mapping({"network": True}).network is True
    listed = policy_from_mapping({"network": {"allow": ["localhost:8080", "*.pypi.org"], "deny": ["evil.com"]}})
    rules = egress_rules(listed)
    assert rules is not None and [e.text for e in rules.deny] == ["evil.com"]
    assert sandbox_spec(listed).network is False  # no direct network: only the proxy
    assert effective(listed, {"max_output_bytes": 10}).network == listed.network  # dumped and validated again
    with pytest.raises(ValueError, match="'network': 'allow': 'not a host'"):
        policy_from_mapping({"network": {"allow": ["not a host"]}})
    with pytest.raises(ValueError, match="network is on, off"):
        policy_from_mapping({"network": "sometimes"})


# ---------------------------------------------------------------- the proxy, over real sockets


async def test_a_listed_name_is_reached_over_connect_http_and_socks(upstream: Upstream) -> None:
    proxy = Proxy(EgressRules.build(allow=[f"localhost:{upstream.port}"]))
    reply, body = await _connect_tunnel(proxy.port, f"localhost:{upstream.port}")
    assert b" 200 " in reply and body.endswith(BODY)
    request = (f"GET http://localhost:{upstream.port}/page?q=1 HTTP/1.1\r\nHost: localhost:{upstream.port}\r\n"
               "Proxy-Authorization: Basic c2VjcmV0\r\nConnection: keep-alive\r\n\r\n")
    forwarded = await _exchange(proxy.port, request.encode())
    assert forwarded.endswith(BODY)
    code, socks_body = await _socks(proxy.port, "localhost", upstream.port)
    assert code == 0 and socks_body.endswith(BODY)
    assert upstream.hits == ["GET / HTTP/1.1", "GET /page?q=1 HTTP/1.1", "GET / HTTP/1.1"]  # origin-form upstream
    # the proxy's credentials stay with the proxy; one request per upstream connection
    assert "proxy-authorization" not in upstream.heads[1].lower() and "Connection: close" in upstream.heads[1]
    await proxy.proxy.aclose()
    records = proxy.closed()
    assert [r.protocol for r in records] == ["connect", "http", "socks5"]
    for record in records:
        assert record.allowed and record.rule == f"network.allow: localhost:{upstream.port}"
        assert record.host == "localhost" and record.port == upstream.port and record.address == "127.0.0.1"
        assert record.up > 0 and record.down >= len(BODY) and record.ended is not None


async def test_denied_unlisted_and_private_hosts_are_refused_with_their_rule(upstream: Upstream) -> None:
    rules = EgressRules.build(allow=["*", f"localhost:{upstream.port}"], deny=["localhost:1", "*.evil.test"])
    proxy = Proxy(rules)
    cases = {
        "localhost:1": "network.deny: localhost:1",
        "www.evil.test:443": "network.deny: *.evil.test",
        "10.0.0.1:80": "network.special-address",  # private, never dialed
        "169.254.169.254:80": "network.special-address",  # the cloud metadata service
        "[::1]:80": "network.special-address",
        "[::ffff:127.0.0.1]:22": "network.special-address",
        f"127.0.0.1:{upstream.port}": "network.special-address",  # `*` does not open loopback
        # a name resolving to loopback, judged on the address: its entry names another port
        "localhost:80": "network.special-address",
    }
    for target, rule in cases.items():
        status, header, body = _refusal((await _connect_tunnel(proxy.port, target))[0])
        assert (status, header, body["rule"]) == (403, rule, rule), target
        assert body["error"].startswith("tether egress proxy: ")
    code, _ = await _socks(proxy.port, socket.inet_aton("192.168.1.1"), 80)
    assert code == 2  # SOCKS5 "connection not allowed by ruleset"
    assert upstream.hits == []
    only_listed = Proxy(EgressRules.build(allow=["pypi.org"]))
    status, rule, _ = _refusal(await _exchange(only_listed.port, f"GET http://localhost:{upstream.port}/ HTTP/1.1"
                                                                 "\r\n\r\n".encode()))
    assert (status, rule) == (403, "network.not-allowed")
    code, _ = await _socks(only_listed.port, "localhost", upstream.port)
    assert code == 2
    await proxy.proxy.aclose()
    await only_listed.proxy.aclose()
    refused = [r for r in proxy.closed() + only_listed.closed() if not r.allowed]
    assert len(refused) == len(cases) + 3 and all(r.rule.startswith("network.") for r in refused)


async def test_a_name_resolving_to_loopback_is_refused_unless_listed(upstream: Upstream) -> None:
    """`*.localhost`-style wildcards and `*` do not open loopback: only the exact name or the address does."""
    wildcard = Proxy(EgressRules.build(allow=["*", "*.localhost"]))
    status, rule, body = _refusal((await _connect_tunnel(wildcard.port, f"localhost:{upstream.port}"))[0])
    assert (status, rule) == (403, "network.special-address") and "loopback" in body["error"]
    by_address = Proxy(EgressRules.build(allow=["127.0.0.0/8"]))
    reply, body_ok = await _connect_tunnel(by_address.port, f"127.0.0.1:{upstream.port}")
    assert b" 200 " in reply and body_ok.endswith(BODY)
    for proxy in (wildcard, by_address):
        await proxy.proxy.aclose()
    assert [r.rule for r in by_address.closed()] == ["network.allow: 127.0.0.0/8"]


async def test_a_listed_port_nobody_listens_on_is_a_502_naming_the_refusal() -> None:
    """The upstream connect's outcome, told within connect() on loopback, reaches the caller with its rule."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # bound, never listening: a connect is refused (RST) by the kernel
    proxy = Proxy(EgressRules.build(allow=[f"127.0.0.1:{port}"]))
    status, rule, body = _refusal((await _connect_tunnel(proxy.port, f"127.0.0.1:{port}"))[0])
    assert (status, rule) == (502, "network.connect") and "Connection refused" in body["error"]
    code, _ = await _socks(proxy.port, socket.inet_aton("127.0.0.1"), port)
    assert code == 5  # SOCKS5 "connection refused"
    await proxy.proxy.aclose()
    assert [r.rule for r in proxy.closed()] == ["network.connect", "network.connect"]


async def test_the_proxy_bounds_what_it_waits_for() -> None:
    proxy = Proxy(EgressRules.build(allow=["*"]), Limits(head_timeout_s=0.3, max_head_bytes=1024))
    status, rule, _ = _refusal(await _exchange(proxy.port, b"GET http://x/ HTTP/1.1\r\nX: " + b"a" * 2000))
    assert (status, rule) == (431, "network.request-too-large")
    status, rule, _ = _refusal(await _exchange(proxy.port, b"GET http://x/ HTTP/1.1\r\n"))  # never finishes
    assert (status, rule) == (408, "network.request-timeout")
    status, rule, _ = _refusal(await _exchange(proxy.port, b"GET /not-a-proxy-request HTTP/1.1\r\n\r\n"))
    assert (status, rule) == (400, "network.bad-request")
    await proxy.proxy.aclose()


# ---------------------------------------------------------------- inside a real sandbox


@pytest.fixture
async def box(tmp_path: Path, upstream: Upstream) -> AsyncIterator[tuple[Sandbox, list[tuple[str, EgressRecord]]]]:
    info = detect()
    if not info.available:
        pytest.fail(f"the egress tests need bubblewrap (apt-get install -y bubblewrap): {info.detail}")
    (tmp_path / "root").mkdir()
    spec = SandboxSpec.build(write_roots=[str(tmp_path / "root")], network=False, layers_dir=str(tmp_path / "layers"))
    audited: list[tuple[str, EgressRecord]] = []
    rules = EgressRules.build(allow=[f"localhost:{upstream.port}"], deny=["*.evil.test"])
    sandbox = Sandbox(info, spec, egress=rules, audit=lambda r, e: audited.append((e, r)))
    try:
        yield sandbox, audited
    finally:
        await sandbox.aclose()


async def _run(sandbox: Sandbox, argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str, list[str]]:
    proc = await sandbox.spawn(argv, executable=argv[0], cwd="/", env=env or {"PATH": "/usr/bin:/bin"},
                               stdin=False, layer=None)
    assert proc.stdout is not None and proc.stderr is not None
    async with asyncio.timeout(30):
        out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
        code = await proc.wait()
    return code, out.decode(), err.decode(), proc.notes


async def test_curl_in_the_sandbox_goes_through_the_proxy_and_nowhere_else(
        box: tuple[Sandbox, list[tuple[str, EgressRecord]]], upstream: Upstream,
        caplog: pytest.LogCaptureFixture) -> None:
    sandbox, audited = box
    curl = _require("curl", "apt-get install -y curl")
    caplog.set_level(logging.INFO, logger="tether.sandbox.egress")
    # the environment it is given ($HTTP_PROXY...) takes plain curl through the proxy
    code, out, err, notes = await _run(sandbox, [curl, "-sS", f"http://localhost:{upstream.port}/"],
                                       {"PATH": "/usr/bin:/bin", "NO_PROXY": "*"})
    assert (code, out) == (0, BODY.decode()), err
    assert len(notes) == 1 and f"allowed by network.allow: localhost:{upstream.port}" in notes[0]
    # SOCKS5 with the name resolved by the proxy (socks5h), as ALL_PROXY says
    port = sandbox.proxy_env()["ALL_PROXY"].rsplit(":", 1)[1]
    code, out, err, _ = await _run(sandbox, [curl, "-sS", "--proxy", f"socks5h://127.0.0.1:{port}",
                                             f"http://localhost:{upstream.port}/"])
    assert (code, out) == (0, BODY.decode()), err
    # a denied host: the 403 and its rule reach the command, and its notes
    code, out, err, notes = await _run(sandbox, [curl, "-sS", "-o", "/dev/stdout", "-w", "%{http_code}",
                                                 "http://www.evil.test/"])
    assert out.endswith("403") and '"rule": "network.deny: *.evil.test"' in out
    assert notes == ["network: www.evil.test:80 refused by network.deny: *.evil.test: www.evil.test:80 is denied "
                     "by the policy"]
    # https through CONNECT to an unlisted host: refused before any byte of TLS
    code, out, err, notes = await _run(sandbox, [curl, "-sS", "https://example.com/"])
    assert code != 0 and "403" in err and "network.not-allowed" in notes[0]
    # skipping the proxy: the sandbox has no route anywhere, not even to this machine's loopback
    code, out, err, notes = await _run(sandbox, [curl, "-sS", "--noproxy", "*", "--connect-timeout", "5",
                                                 f"http://127.0.0.1:{upstream.port}/"])
    assert code == 7 and notes == []  # "Failed to connect": nothing listens there in the sandbox's namespace
    assert len(upstream.hits) == 2
    opened = [r for e, r in audited if e == "open"]
    assert [(r.host, r.allowed, r.owner is not None) for r in opened] == [
        ("localhost", True, True), ("localhost", True, True), ("www.evil.test", False, True),
        ("example.com", False, True)]
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "tether.sandbox.egress"]
    assert any("refused by network.deny: *.evil.test" in line for line in logged)
    assert any(f"localhost:{upstream.port} (127.0.0.1) allowed" in line and "bytes up" in line for line in logged)


async def test_a_direct_socket_from_an_interpreter_reaches_nothing(
        box: tuple[Sandbox, list[tuple[str, EgressRecord]]], upstream: Upstream) -> None:
    sandbox, audited = box
    python = os.path.realpath(sys.executable)
    code, out, err, _ = await _run(sandbox, [python, "-c", f"""
import socket
for target in [("127.0.0.1", {upstream.port}), ("1.1.1.1", 53), ("10.0.0.1", 80)]:
    try:
        socket.create_connection(target, timeout=3).close()
        print("reached", target)
    except OSError as exc:
        print("refused", type(exc).__name__)
print(sorted(name for _, name in socket.if_nameindex()))
"""])
    assert code == 0, err
    lines = out.splitlines()
    assert all(line.startswith("refused") for line in lines[:3]), out
    assert lines[3] == "['lo']"
    assert upstream.hits == [] and audited == []


async def test_a_device_runs_curl_through_the_proxy_and_its_result_carries_the_notes(
        tmp_path: Path, upstream: Upstream, monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.device.local import build_device
    from tether.protocol.models import Command

    curl = _require("curl", "apt-get install -y curl")
    monkeypatch.setenv("HOME", str(tmp_path))
    policy = policy_from_mapping({"require_sandbox": True, "commands": {"curl": {}},
                                  "network": {"allow": [f"localhost:{upstream.port}"]}})
    device = build_device(policy=policy, state_dir=tmp_path / "state", sandbox=True)
    try:
        await device.computer_manager.get_or_create(None)
        dispatcher = device.dispatcher(session_id="egress")
        calls = [Command(tool_name="shell.run", parameters={"cmd": curl, "argv": ["-sS", url], "cwd": str(tmp_path)})
                 for url in (f"http://localhost:{upstream.port}/", "http://127.0.0.1:22/")]
        async with asyncio.timeout(60):
            allowed, refused = await dispatcher.execute_commands(calls)
    finally:
        await device.aclose()
    assert allowed.ok and allowed.result["stdout"] == BODY.decode(), allowed
    assert "allowed by network.allow" in allowed.result["notes"][0]
    assert refused.result["notes"][0].startswith("network: 127.0.0.1:22 refused by network.not-allowed")
    assert '"rule": "network.not-allowed"' in refused.result["stdout"]


async def test_each_connection_is_told_to_the_command_that_made_it_while_several_run(
        box: tuple[Sandbox, list[tuple[str, EgressRecord]]], upstream: Upstream) -> None:
    """Two commands alive at once, each fetching through the proxy: each one's notes hold its own connection."""
    sandbox, audited = box
    python = os.path.realpath(sys.executable)
    code = """
import sys, urllib.request, urllib.error
sys.stdin.readline()
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode().strip(), flush=True)
except urllib.error.HTTPError as exc:
    print(exc.code, exc.headers["X-Tether-Rule"], flush=True)
sys.stdin.read()
"""
    env = {"PATH": "/usr/bin:/bin"}
    procs = [await sandbox.spawn([python, "-c", code, url], executable=python, cwd="/", env=env, stdin=True,
                                 layer=None)
             for url in (f"http://localhost:{upstream.port}/", "http://www.evil.test/")]
    lines = []
    async with asyncio.timeout(30):
        for proc in procs:  # one at a time, while both are running
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
            lines.append((await proc.stdout.readline()).decode().strip())
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
            assert await proc.wait() == 0
    assert lines == [BODY.decode().strip(), "403 network.deny: *.evil.test"]
    first, second = (proc.notes for proc in procs)
    assert len(first) == 1 and first[0].startswith(f"network: localhost:{upstream.port} (127.0.0.1) allowed")
    assert len(second) == 1 and second[0].startswith("network: www.evil.test:80 refused by network.deny")
    assert len({r.owner for e, r in audited if e == "open"}) == 2


async def test_ask_on_miss_asks_about_an_unlisted_host_once_always_or_deny(upstream: Upstream) -> None:
    """The proxy's hook for `ask: on-miss`: a person's "once" opens one connection, "always" opens the host for
    good, "deny" refuses; a listed-but-denied host is never asked about."""
    answers: list[str] = ["once", "deny", "always"]
    asked: list[tuple[str, int]] = []

    async def ask(host: str, port: int, owner: int | None) -> Any:
        asked.append((host, port))
        return answers.pop(0)

    rules = EgressRules.build(allow=["127.0.0.0/8"], deny=["127.0.0.2"], ask="on-miss")
    records: list[EgressRecord] = []
    proxy = EgressProxy(rules, audit=lambda r, e: e == "close" and records.append(r), ask=ask)
    listener = socket.create_server(("127.0.0.1", 0))
    proxy.serve(listener)
    port = listener.getsockname()[1]
    target = f"localhost:{upstream.port}"  # unlisted by name (its addresses are listed, the name is not)
    once = await _connect_tunnel(port, target)
    denied = _refusal((await _connect_tunnel(port, target))[0])
    always = await _connect_tunnel(port, target)
    again = await _connect_tunnel(port, target)  # not asked again
    never = _refusal((await _connect_tunnel(port, "127.0.0.2:80"))[0])
    await proxy.aclose()
    assert once[1].endswith(BODY) and always[1].endswith(BODY) and again[1].endswith(BODY)
    assert denied[:2] == (403, "network.ask: deny") and never[:2] == (403, "network.deny: 127.0.0.2")
    assert asked == [("localhost", upstream.port)] * 3
    address = "network.allow: 127.0.0.0/8"  # what opened the loopback address the name resolved to
    assert [r.rule for r in records] == [
        f"network.ask: once; {address}", "network.ask: deny", f"network.ask: always; {address}",
        f"network.allow: localhost:{upstream.port}; {address}", "network.deny: 127.0.0.2"]


async def _hold_tunnel(port: int, target: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
    assert b" 200 " in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT_S)
    return reader, writer


async def test_connection_floods_and_odd_names_are_bounded(upstream: Upstream) -> None:
    """One command cannot hold more than its share of tunnels; past the global cap connections wait for a slot;
    names that are not names are refused before any resolver sees them."""
    target = f"127.0.0.1:{upstream.port}"
    per_command = Proxy(EgressRules.build(allow=[target]), Limits(max_per_command=2))
    held = [await _hold_tunnel(per_command.port, target) for _ in range(2)]
    status, rule, _ = _refusal((await _connect_tunnel(per_command.port, target))[0])
    assert (status, rule) == (429, "network.max-connections")
    for bad in ("a..b:80", "x" * 300 + ":80", "bad_host\x00.test:80", "exa mple.com:80"):
        status, rule, _ = _refusal((await _connect_tunnel(per_command.port, bad))[0])
        assert (status, rule) == (400, "network.bad-request"), bad
    # the global cap: with two open, a third is accepted only when one ends
    overall = Proxy(EgressRules.build(allow=[target]), Limits(max_connections=2))
    held += [await _hold_tunnel(overall.port, target) for _ in range(2)]
    waiting = asyncio.ensure_future(_exchange(overall.port, f"GET http://{target}/ HTTP/1.1\r\n\r\n".encode()))
    done, _ = await asyncio.wait([waiting], timeout=0.2)
    assert not done  # in the listen backlog, not served
    held[-1][1].close()
    assert (await asyncio.wait_for(waiting, IO_TIMEOUT_S)).endswith(BODY)
    for _, writer in held:
        writer.close()
    for proxy in (per_command, overall):
        await proxy.proxy.aclose()


UNPRIVILEGED = r'''
import asyncio, json, os, sys, tempfile
from tether.sandbox import SandboxSpec, detect
from tether.sandbox.egress.rules import EgressRules
from tether.sandbox.runner import Sandbox

async def serve(reader, writer):
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n")
    await writer.drain()
    writer.close()

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    work = tempfile.mkdtemp(dir=os.environ["HOME"])
    os.mkdir(work + "/root")
    audited = []
    box = Sandbox(detect(), SandboxSpec.build(write_roots=[work + "/root"], network=False,
                                              layers_dir=work + "/layers"),
                  egress=EgressRules.build(allow=[f"localhost:{port}"]), audit=lambda r, e: audited.append(e))
    report = {"uid": os.getuid()}
    try:
        for name, url in (("allowed", f"http://localhost:{port}/"), ("refused", f"http://127.0.0.1:{port}/")):
            proc = await box.spawn([sys.argv[1], "-sS", url], executable=sys.argv[1], cwd="/",
                                   env={"PATH": "/usr/bin:/bin"}, stdin=False, layer=None)
            out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
            report[name] = {"code": await proc.wait(), "out": out.decode(), "err": err.decode(), "notes": proc.notes}
    finally:
        await box.aclose()
        server.close()
    report["audited"] = audited
    print("REPORT " + json.dumps(report))

asyncio.run(main())
'''


def test_the_proxy_holds_for_an_unprivileged_user(tmp_path: Path) -> None:
    """The same promises when the device is an ordinary user (CI runs as root): the helpers that make the user
    and an interpreter it can run are the unprivileged sandbox test's."""
    from tests.attacks import test_sandbox_unprivileged as unprivileged

    curl = _require("curl", "apt-get install -y curl")
    where = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-egress-run-"))
    try:
        where.chmod(0o755)
        script = where / "egress.py"
        script.write_text(UNPRIVILEGED)
        script.chmod(0o644)
        if os.geteuid() == 0:
            user = unprivileged._ensure_user()
            unprivileged._check_readable(user.pw_name)
            python = unprivileged._python_for(user.pw_name, where)
            env = {"HOME": user.pw_dir, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
            argv = ["runuser", "-u", user.pw_name, "--", "env", "-i", *[f"{k}={v}" for k, v in env.items()],
                    python, str(script), curl]
        else:
            argv = [sys.executable, str(script), curl]
        done = subprocess.run(argv, capture_output=True, text=True, cwd=where, timeout=120, check=False)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert line, f"the script failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    report = json.loads(line.removeprefix("REPORT "))
    assert report["uid"] != 0 or os.geteuid() != 0
    allowed, refused = report["allowed"], report["refused"]
    assert (allowed["code"], allowed["out"]) == (0, "ok\n"), allowed
    assert "allowed by network.allow" in allowed["notes"][0]
    assert '"rule": "network.not-allowed"' in refused["out"] and "refused by network.not-allowed" in refused["notes"][0]
    assert report["audited"] == ["open", "close", "open", "close"]


async def test_a_commands_own_asker_answers_for_its_unlisted_hosts(tmp_path: Path, upstream: Upstream) -> None:
    """`ask: on-miss` in a real sandbox: the asker given to spawn() is asked about that command's connection
    (with its request id); a command spawned without one keeps the plain refusal."""
    curl = _require("curl", "apt-get install -y curl")
    spec = SandboxSpec.build(write_roots=[], network=False, layers_dir=str(tmp_path / "layers"))
    box = Sandbox(detect(), spec, egress=EgressRules.build(allow=["127.0.0.0/8"], ask="on-miss"))
    asked: list[tuple[str, int, int | None]] = []

    async def ask(host: str, port: int, owner: int | None) -> Any:
        asked.append((host, port, owner))
        return "once"

    url = f"http://localhost:{upstream.port}/"
    try:
        results = []
        for asker in (ask, None):
            proc = await box.spawn([curl, "-sS", url], executable=curl, cwd="/", env={"PATH": "/usr/bin:/bin"},
                                   stdin=False, layer=None, ask=asker)
            assert proc.stdout is not None
            async with asyncio.timeout(30):
                out = await proc.stdout.read()
                await proc.wait()
            results.append((out.decode(), proc.notes))
    finally:
        await box.aclose()
    assert results[0][0] == BODY.decode() and "allowed by network.ask: once" in results[0][1][0]
    assert '"rule": "network.not-allowed"' in results[1][0]
    assert len(asked) == 1 and asked[0][:2] == ("localhost", upstream.port) and asked[0][2] is not None


async def test_a_restarted_warden_gets_a_new_proxy_listener_and_the_old_one_is_dropped(
        box: tuple[Sandbox, list[tuple[str, EgressRecord]]], upstream: Upstream) -> None:
    sandbox, _ = box
    curl = _require("curl", "apt-get install -y curl")
    url = f"http://localhost:{upstream.port}/"
    assert (await _run(sandbox, [curl, "-sS", url]))[:2] == (0, BODY.decode())
    proc, warden = sandbox._proc, sandbox._warden_host_pid
    assert proc is not None and warden is not None
    os.kill(warden, signal.SIGKILL)
    await asyncio.wait_for(proc.wait(), IO_TIMEOUT_S)
    code, out, err, notes = await _run(sandbox, [curl, "-sS", url])
    assert (code, out) == (0, BODY.decode()), err
    assert sandbox.proxy_env() and "allowed by" in notes[0]
    # the old listener's accept loop ended with its warden: one listener is served, the new one
    assert sandbox._proxy_task is not None and len(sandbox.egress._servers) == 1  # type: ignore[union-attr]
