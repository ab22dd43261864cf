"""The cluster harness (clusterkit.py) and devices given several server URLs (issue 16).

Real `tether server` and `tether device` processes on loopback ports, two nodes sharing one database;
the Redis link proxy against a real redis-server. A device given several URLs that loses its node
(kill -9) registers on the next one by itself, inside the grace period, and runs commands there.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.kit.engines import Engine
from tests.kits.cluster import WAIT, ClusterKit, RedisLink, free_port
from tether.device.link.reconnect import ServerURLs


def hello(kit: ClusterKit) -> list[dict[str, Any]]:
    """A real process on the device (sandboxed `echo`)."""
    return [{"tool_name": "shell.run", "parameters": {"cmd": "echo", "argv": ["hello"], "cwd": str(kit.tmp)}}]


@pytest.fixture
async def kit(tmp_path: Path) -> Any:
    async with ClusterKit(tmp_path) as kit:
        yield kit


def _ok(response: Any) -> str:
    assert response.status_code == 200, response.text
    [result] = response.json()["results"]
    assert result["status"] == "success", result
    return str(result["result"])


# ------------------------------------------------------------------ the policy, without a server


def test_the_device_stays_on_a_working_url_and_backs_off_once_per_round() -> None:
    urls = ServerURLs(["ws://a/aip", "ws://b/aip", "ws://c/aip", "ws://a/aip"])
    assert urls.urls == ["ws://a/aip", "ws://b/aip", "ws://c/aip"]  # a URL given twice is tried once a round
    assert urls.current == "ws://a/aip"
    assert [urls.advance() for _ in range(6)] == [False, False, True, False, False, True]
    assert urls.current == "ws://a/aip"
    urls.advance()  # on b, lost: the next two are not a full round since it registered on b
    urls.registered()
    assert (urls.advance(), urls.current) == (False, "ws://c/aip")
    single = ServerURLs(["ws://only/aip"])
    assert all(single.advance() for _ in range(3))  # one server: every failure is a round, as before
    with pytest.raises(ValueError):
        ServerURLs([])


@pytest.mark.sqlite_only(reason="POSIX locks on a SQLite file shared by processes")
def test_nodes_sharing_one_sqlite_file_see_each_others_writes(tmp_path: Path) -> None:
    """A server process opens the database twice (its Store, then the agent's TaskStore). The TaskStore
    used to open and close a plain descriptor of the file, which drops every POSIX lock the process
    holds on it: the next process to close its own connection then deleted the WAL the server still
    wrote to, and what the server committed afterwards was seen by no one else (found by the cluster
    harness: a token made on node a was unknown to node b)."""
    import sqlite3

    from tether.agent.tasks.store import TaskStore

    db = tmp_path / "shared.db"
    server = sqlite3.connect(db, isolation_level=None)  # the server's own connection, as its Store opens it
    server.execute("PRAGMA journal_mode=WAL")
    server.execute("CREATE TABLE tokens (name TEXT)")
    tasks = TaskStore(db)
    try:
        server.execute("INSERT INTO tokens VALUES ('before')")
        other_node = f"import sqlite3; sqlite3.connect({str(db)!r}).execute('SELECT count(*) FROM tokens').fetchall()"
        subprocess.run([sys.executable, "-c", other_node], check=True, timeout=60)  # another node comes and goes
        assert Path(f"{db}-wal").exists(), "the running server's WAL was deleted under it"
        server.execute("INSERT INTO tokens VALUES ('after')")
        other = sqlite3.connect(db)
        assert {r[0] for r in other.execute("SELECT name FROM tokens")} == {"before", "after"}
        other.close()
    finally:
        tasks.close()
        server.close()


async def test_a_connection_checks_every_url_it_is_given(tmp_path: Path) -> None:
    from tether.device.config import parse_device_config
    from tether.device.link.connection import DeviceConnection, ServerTrust
    from tether.device.local import build_device

    device = build_device(parse_device_config({"device": {"name": "x", "builtin": ["system"]}}),
                          state_dir=tmp_path, sandbox=False)
    client = device.client
    pin = "ab" * 32
    link = DeviceConnection(client, ["wss://n1:8765/aip", "wss://n2:8765/aip"], "t",
                            trust=ServerTrust(tls_fingerprint=pin))
    assert link.url == "wss://n1:8765/aip" and link.servers.urls == ["wss://n1:8765/aip", "wss://n2:8765/aip"]
    with pytest.raises(ValueError, match="is not a wss:// URL: nothing would be pinned"):
        DeviceConnection(client, ["ws://n1:8765/aip", "ws://n2:8765/aip"], "t", trust=ServerTrust(tls_fingerprint=pin))
    with pytest.raises(ValueError, match="mix ws:// and wss://"):
        DeviceConnection(client, ["ws://n1:8765/aip", "wss://n2:8765/aip"], "t")
    with pytest.raises(ValueError, match="not a usable server URL"):
        DeviceConnection(client, ["ws://n1:8765/aip", "n2 8765"], "t")
    await device.aclose()


# ------------------------------------------------------------------ real nodes and devices


async def test_a_device_moves_to_the_next_node_when_its_node_is_killed(kit: ClusterKit) -> None:
    a, b = await kit.start_node("a"), await kit.start_node("b")
    laptop = await kit.start_device("laptop", [a, b])
    assert await laptop.registered() is a
    assert "hello" in _ok(await kit.run(a, "laptop", hello(kit)))
    since = len(laptop.process.lines)
    await kit.kill_node(a)
    assert a.process.proc is not None and a.process.proc.returncode == -9
    started = asyncio.get_running_loop().time()
    assert await laptop.registered(since) is b
    took = asyncio.get_running_loop().time() - started
    hb = kit.heartbeat
    assert took < hb["timeout"] + hb["grace"], f"back on b after {took:.1f} s"
    assert "hello" in _ok(await kit.run(b, "laptop", hello(kit)))
    # the token travelled in the environment, which the device cleared: not on its command line
    secret = await kit.token("device", "other")
    other = await kit.start_device("other", [b], token=secret)
    await other.registered()
    cmdline = Path(f"/proc/{other.process.pid}/cmdline").read_bytes()
    environ = Path(f"/proc/{other.process.pid}/environ").read_bytes()
    assert secret.encode() not in cmdline and secret.encode() not in environ


async def test_a_dead_first_url_costs_one_attempt_and_a_restarted_node_is_found_again(kit: ClusterKit) -> None:
    b = await kit.start_node("b")
    dead = free_port()
    device = await kit.start_device("phone", [], extra=["--server", f"ws://127.0.0.1:{dead},{b.ws_url}"])
    await device.process.wait_line(rf"registered as phone via ws://127\.0\.0\.1:{b.port}/aip")
    # b restarts (same port): the device comes back to it, trying the dead URL in between
    since = len(device.process.lines)
    await kit.kill_node(b)
    await kit.start_node("b")
    await device.process.wait_line(rf"registered as phone via .*:{b.port}/aip \(reconnected\)", since)
    assert "hello" in _ok(await kit.run(kit.node("b"), "phone", hello(kit)))


async def _device_cli(tmp_path: Path, *args: str, config: str | None = None) -> tuple[int, str]:
    env = {**os.environ, "NO_COLOR": "1", "TETHER_DEVICE_TOKEN": "not-used", "TETHER_STATE_DIR": str(tmp_path)}
    if config is not None:
        (tmp_path / "device.yaml").write_text(config)
        args = (*args, "--config", str(tmp_path / "device.yaml"))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "tether.cli", "device", *args,
                                                "--state-dir", str(tmp_path / "dev"), env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    async with asyncio.timeout(WAIT):
        out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_unusable_server_lists_are_one_line_errors(tmp_path: Path) -> None:
    code, out = await _device_cli(tmp_path, "--server", "ws://127.0.0.1:1,wss://127.0.0.1:2")
    assert code == 2 and "error: the server URLs mix ws:// and wss://" in out and "Traceback" not in out
    code, out = await _device_cli(tmp_path, config="server:\n  url: ws://127.0.0.1:1\n  urls: [ws://127.0.0.1:2]\n")
    assert code == 2 and "error: the config's server: section has both url and urls" in out
    assert "Traceback" not in out
    code, out = await _device_cli(tmp_path, "--server", "ftp://127.0.0.1:1")
    # one error line (the suite runs as root with run_as: root, so a root warning may come first)
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in out
    assert "'ftp://127.0.0.1:1' is not a usable server URL" in errors[0] and "ws://HOST:PORT" in errors[0], errors


async def test_the_config_lists_a_clusters_nodes(kit: ClusterKit, tmp_path: Path) -> None:
    a, b = await kit.start_node("a"), await kit.start_node("b")
    await kit.stop_node(a)  # the first node in the config is down: the device finds b
    config = tmp_path / "laptop.yaml"
    config.write_text(f"server:\n  urls: [{a.url}, {b.url}]\n")  # http:// URLs become ws://…/aip
    laptop = await kit.start_device("laptop", [], extra=["--config", str(config)])
    laptop.nodes = [a, b]
    assert await laptop.registered() is b


# ------------------------------------------------------------------ the Redis link


async def test_the_redis_link_cuts_black_holes_and_restores(redis_engine: Engine) -> None:
    import redis.asyncio as aioredis
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    link = await RedisLink(redis_engine.port).start()
    client = aioredis.from_url(link.url(), socket_timeout=1, socket_connect_timeout=1)
    try:
        assert await client.ping()
        link.cut()
        with pytest.raises((RedisConnectionError, RedisTimeoutError)):
            await client.ping()
        link.restore()
        assert await client.ping()  # a new connection through the link
        link.cut(blackhole=True)
        with pytest.raises(RedisTimeoutError):  # no reset: the client learns only by its own timeout
            await client.ping()
        link.restore()
        assert await client.ping()
    finally:
        await client.aclose()
        await link.aclose()
