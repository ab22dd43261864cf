"""A cluster of real `tether server` processes for tests and benchmarks (issue 16).

    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b = await kit.start_node("a"), await kit.start_node("b")
        laptop = await kit.start_device("laptop", [a, b])      # `tether device --server A --server B`
        await laptop.registered()                              # its "registered as" line
        answer = await kit.run(b, "laptop", [...])             # POST /api/v1/devices/laptop/commands on b
        await kit.kill_node(a)                                 # kill -9
        a.redis_link.cut()                                     # partition a from Redis; .restore() heals it

What is real: every node is a `python -m tether.cli server` process on a free loopback port with its own
state directory, all sharing one database (`db`: a SQLite file by default; pass a `postgresql://` URL
for PostgreSQL) and one redis-server (bench/kit/engines.py). Each node reaches Redis through its own
`RedisLink`, a loopback TCP proxy the test can cut (a partition) and restore. Devices are real
`tether device` processes; their tokens travel in TETHER_DEVICE_TOKEN, never on a command line.

Nothing here sleeps to wait: readiness is a process's own line on its output pipe ("Uvicorn running
on" for a node, "registered as" for a device), and every wait has an upper bound that fails with the
process's output. Without `redis` the nodes start without --cluster (plain single servers sharing a
database), which is also how the harness itself is tested before the cluster options exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.kit import ports
from tests.kits.db import keeps_server_state, server_db
from tests.kits.netutil import workspace_policy

WAIT = 60.0  # the upper bound of any wait here: a loaded 2-core machine starts a node in seconds
HEARTBEAT = {"interval": 0.3, "timeout": 2.0, "grace": 3.0}
NODE_READY = "Uvicorn running on"
CLI = [sys.executable, "-m", "tether.cli"]


def free_port() -> int:
    """A port for a node about to start; parallel-safe (bench/kit/ports.py)."""
    return ports.free_port()


class Process:
    """A child process whose output (stdout and stderr together) is kept line by line and copied to a
    log file, so a test can wait for a line and a failure can show what the process said."""

    def __init__(self, label: str, log: Path) -> None:
        self.label = label
        self.log = log
        self.lines: list[str] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._changed = asyncio.Condition()
        self._reader: asyncio.Task[None] | None = None

    async def start(self, argv: Sequence[str], env: dict[str, str]) -> Process:
        self.proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                         stderr=asyncio.subprocess.STDOUT, env=env,
                                                         stdin=asyncio.subprocess.DEVNULL, limit=1 << 20)
        self._reader = asyncio.create_task(self._read(), name=f"read-{self.label}")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log.open("a", encoding="utf-8") as out:
            while True:
                try:
                    raw = await self.proc.stdout.readline()
                except ValueError:  # a line past the stream's limit: keep what fits
                    raw = await self.proc.stdout.read(65536)
                async with self._changed:
                    if raw:
                        line = raw.decode(errors="replace").rstrip("\n")
                        self.lines.append(line)
                        out.write(line + "\n")
                        out.flush()
                    self._changed.notify_all()
                if not raw:
                    break
        await self.proc.wait()
        async with self._changed:
            self._changed.notify_all()

    def output(self, last: int = 60) -> str:
        return "\n".join(self.lines[-last:])

    async def wait_line(self, pattern: str, since: int = 0, timeout: float = WAIT) -> re.Match[str]:
        """The first line from index `since` on matching the regular expression `pattern`. Fails with the
        process's output if it exits first or `timeout` passes."""
        regex = re.compile(pattern)
        index = since
        try:
            async with asyncio.timeout(timeout), self._changed:
                while True:
                    for i in range(index, len(self.lines)):
                        if match := regex.search(self.lines[i]):
                            return match
                    index = len(self.lines)
                    if self._reader is not None and self._reader.done():
                        raise AssertionError(f"{self.label} exited ({self.proc and self.proc.returncode}) "
                                             f"before printing /{pattern}/; its output:\n{self.output()}")
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"{self.label} printed no /{pattern}/ within {timeout:g} s; its output:\n"
                                 f"{self.output()}") from None

    async def kill(self) -> None:
        """kill -9: no shutdown handler runs, no lease is released, no socket is closed politely."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
        await self._finished(WAIT)

    async def stop(self, grace: float = 30.0) -> int | None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                await self._finished(grace)
            except TimeoutError:
                self.proc.send_signal(signal.SIGKILL)
        await self._finished(WAIT)
        return self.proc.returncode if self.proc else None

    async def _finished(self, timeout: float) -> None:
        if self.proc is None:
            return
        async with asyncio.timeout(timeout):
            await self.proc.wait()
            if self._reader is not None:
                await self._reader


class RedisLink:
    """A loopback TCP proxy between one node and Redis, which the test can cut and restore.

    `cut()` is a partition the node notices at once (every connection reset, new ones refused);
    `cut(blackhole=True)` one it notices only by its own timeouts (connections stay open, nothing is
    forwarded either way, new ones are accepted and left hanging). `restore()` forwards again; the
    connections held during a black hole are reset then, as they would time out on a real network."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.state = "up"  # "up" | "reset" | "blackhole"
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._live: set[asyncio.StreamWriter] = set()
        self._held: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> RedisLink:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def cut(self, *, blackhole: bool = False) -> None:
        self.state = "blackhole" if blackhole else "reset"
        if blackhole:
            self._held |= self._live
        else:
            self._abort(self._live)
        self._live = set()

    def restore(self) -> None:
        self.state = "up"
        self._abort(self._held)
        self._held = set()

    @staticmethod
    def _abort(writers: set[asyncio.StreamWriter]) -> None:
        for writer in writers:
            writer.transport.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.state == "reset":
            writer.transport.abort()
            return
        if self.state == "blackhole":
            self._held.add(writer)
            return
        try:
            async with asyncio.timeout(10):
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except (OSError, TimeoutError):
            writer.transport.abort()
            return
        pair = {writer, up_writer}
        self._live |= pair
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await asyncio.gather(self._pipe(reader, up_writer, pair), self._pipe(up_reader, writer, pair))
        finally:
            self._tasks.discard(task)
            self._live -= pair

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    pair: set[asyncio.StreamWriter]) -> None:
        with contextlib.suppress(Exception):
            while data := await src.read(65536):
                if pair & self._held:  # black-holed: swallow what arrives, forward nothing
                    continue
                dst.write(data)
                await dst.drain()
        if not pair & self._held:
            dst.close()

    async def aclose(self) -> None:
        self.restore()
        self._abort(self._live)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    await self._server.wait_closed()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10)


class Node:
    """One `tether server` process of the kit."""

    def __init__(self, name: str, port: int, process: Process, redis_link: RedisLink | None) -> None:
        self.name = name
        self.port = port
        self.process = process
        self.redis_link = redis_link
        self.url = f"http://127.0.0.1:{port}"
        self.ws_url = f"ws://127.0.0.1:{port}/aip"

    def __repr__(self) -> str:
        return f"Node({self.name!r}, port={self.port})"


class Device:
    """One `tether device` process of the kit, given one or several nodes' URLs."""

    def __init__(self, name: str, process: Process, nodes: list[Node]) -> None:
        self.name = name
        self.process = process
        self.nodes = nodes

    async def registered(self, since: int = 0, timeout: float = WAIT) -> Node | None:
        """Wait for its next "registered as" line from output line `since` on; the node it names when
        the device was given several URLs (None when the line does not say)."""
        match = await self.process.wait_line(rf"^registered as {re.escape(self.name)}\b(?: via (\S+))?",
                                             since, timeout)
        url = match.group(1)
        return next((n for n in self.nodes if url and url.startswith(n.ws_url)), None)


@keeps_server_state
class ClusterKit:
    """N nodes sharing one database and one Redis, the devices a test starts, and an admin API token.

    `db`: a SQLite path or a `postgresql://` URL (default: tests/kits/db.py's choice for `tmp`/cluster.db, a
    SQLite file, or a database of the session's PostgreSQL with TETHER_TEST_DB=postgres). `redis`: a running
    engine from bench/kit/engines.py, or None for nodes without --cluster. `heartbeat`: the nodes' heartbeat
    interval, heartbeat timeout and grace period in seconds (short, so fail-over fits in a test)."""

    def __init__(self, tmp: Path, *, redis: Any | None = None, db: str | None = None,
                 heartbeat: dict[str, float] | None = None, node_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, log_level: str = "info") -> None:
        self.tmp = tmp
        self.redis = redis
        self.db = db or str(server_db(tmp / "cluster.db"))
        self.heartbeat = {**HEARTBEAT, **(heartbeat or {})}
        self.node_args = list(node_args)
        self.log_level = log_level
        self.env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", **(env or {})}
        for name in ("TETHER_LLM_BASE_URL", "TETHER_LLM_MODEL", "TETHER_CLUSTER", "TETHER_DB_URL",
                     "TETHER_DEVICE_TOKEN"):
            if not (env and name in env):
                self.env.pop(name, None)
        self.nodes: list[Node] = []
        self.devices: list[Device] = []
        self.admin_token = ""
        self._http: dict[str, httpx.AsyncClient] = {}

    async def __aenter__(self) -> ClusterKit:
        self.admin_token = await self._first_token()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ nodes

    async def _first_token(self) -> str:
        """The admin API token, made with `tether token create` against the shared database (so it works
        for either engine), before any node runs; the devices' tokens are made through a node's API."""
        state = self.tmp / "kit-state"
        state.mkdir(exist_ok=True)
        proc = await asyncio.create_subprocess_exec(
            *CLI, "token", "create", "--api", "cluster-kit", "--scope", "read", "--scope", "execute",
            "--scope", "approve", "--scope", "admin", "--db", self.db, "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**self.env, "TETHER_STATE_DIR": str(state)})
        async with asyncio.timeout(WAIT):
            out, err = await proc.communicate()
        if proc.returncode != 0:
            raise AssertionError(f"tether token create failed ({proc.returncode}): {err.decode(errors='replace')}")
        return json.loads(out)["token"]

    def node_argv(self, name: str, port: int, redis_url: str | None) -> list[str]:
        hb = self.heartbeat
        argv = [*CLI, "server", "--port", str(port), "--db", self.db, "--log-level", self.log_level,
                "--heartbeat-interval", str(hb["interval"]), "--heartbeat-timeout", str(hb["timeout"]),
                "--grace-period", str(hb["grace"]), *self.node_args]
        if redis_url is not None:
            argv += ["--cluster", redis_url, "--node-id", name]
        return argv

    async def start_node(self, name: str | None = None, *, port: int | None = None,
                         extra: Sequence[str] = (), env: dict[str, str] | None = None) -> Node:
        """Start a node and wait for its ready line. A name used before (a node killed earlier) starts
        that node again on the same port with the same state directory: a restart."""
        name = name or f"n{len(self.nodes) + 1}"
        before = next((n for n in self.nodes if n.name == name), None)
        if before is not None and before.process.running:
            raise ValueError(f"node {name} is running")
        port = port or (before.port if before else free_port())
        link = before.redis_link if before else None
        if self.redis is not None and link is None:
            link = await RedisLink(self.redis.port).start()
        state = self.tmp / f"node-{name}"
        state.mkdir(exist_ok=True)
        process = Process(f"node {name}", self.tmp / f"node-{name}.log")
        await process.start([*self.node_argv(name, port, link.url() if link else None), *extra],
                            {**self.env, "TETHER_STATE_DIR": str(state), **(env or {})})
        node = Node(name, port, process, link)
        if before is not None:
            self.nodes[self.nodes.index(before)] = node
        else:
            self.nodes.append(node)
        await process.wait_line(re.escape(NODE_READY))
        return node

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    async def kill_node(self, node: Node) -> None:
        """kill -9 the node (its Redis link stays, for a restart with `start_node(node.name)`)."""
        await node.process.kill()

    async def stop_node(self, node: Node) -> int | None:
        return await node.process.stop()

    # ------------------------------------------------------------------ HTTP

    def http(self, node: Node) -> httpx.AsyncClient:
        """A keep-alive client to `node` with the admin token (one per node, closed with the kit)."""
        client = self._http.get(node.url)
        if client is None or client.is_closed:
            client = self._http[node.url] = httpx.AsyncClient(
                base_url=f"{node.url}/api/v1", headers={"Authorization": f"Bearer {self.admin_token}"},
                timeout=httpx.Timeout(WAIT, connect=10))
        return client

    async def token(self, kind: str, name: str, scopes: Sequence[str] = (), via: Node | None = None) -> str:
        node = via or next(n for n in self.nodes if n.process.running)
        response = await self.http(node).post("/tokens", json={"kind": kind, "name": name, "scopes": list(scopes)})
        if response.status_code != 201:
            raise AssertionError(f"making a {kind} token for {name} failed: {response.status_code} {response.text}")
        return response.json()["token"]

    async def health(self, node: Node) -> dict[str, Any]:
        response = await self.http(node).get("/health")
        response.raise_for_status()
        return response.json()

    async def task_frames(self, node: Node, task_id: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Each frame of `node`'s event stream of a task, as (event name, data): stored events first,
        then live ones, then `end`."""
        async with httpx.AsyncClient(base_url=f"{node.url}/api/v1", timeout=httpx.Timeout(WAIT, read=None),
                                     headers={"Authorization": f"Bearer {self.admin_token}"}) as http, \
                http.stream("GET", f"/tasks/{task_id}/events") as response:
            assert response.status_code == 200, await response.aread()
            kind = None
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: ") and kind is not None:
                    yield kind, json.loads(line[6:])

    async def run(self, node: Node, device: str, commands: list[dict[str, Any]], *, timeout: float = 30.0,
                  early_exit: bool = True) -> httpx.Response:
        """POST a batch to `node` for `device` and wait for the answer (the response, whatever its status)."""
        body = {"commands": commands, "timeout": timeout, "early_exit": early_exit}
        return await self.http(node).post(f"/devices/{device}/commands", json=body,
                                          timeout=httpx.Timeout(timeout + WAIT, connect=10))

    # ------------------------------------------------------------------ devices

    async def start_device(self, name: str, nodes: Sequence[Node], *, extra: Sequence[str] = (),
                           token: str | None = None, env: dict[str, str] | None = None) -> Device:
        """A `tether device` given every node of `nodes` as a server URL, in that order (its token is made
        through the first running node's API unless given)."""
        secret = token if token is not None else await self.token("device", name)
        args = ["device", "--name", name, "--state-dir", str(self.tmp / f"device-{name}")]
        if "--policy" not in extra:  # the test's directory in /tmp is a write root (not a session's private /tmp)
            args += ["--policy", str(workspace_policy(self.tmp))]
        for node in nodes:
            args += ["--server", node.ws_url]
        process = Process(f"device {name}", self.tmp / f"device-{name}.log")
        await process.start([*CLI, *args, *extra], {**self.env, "TETHER_STATE_DIR": str(self.tmp / "kit-state"),
                                                    "TETHER_DEVICE_TOKEN": secret, **(env or {})})
        device = Device(name, process, list(nodes))
        self.devices.append(device)
        return device

    # ------------------------------------------------------------------ the end

    async def close(self) -> None:
        for client in self._http.values():
            await client.aclose()
        self._http.clear()
        await asyncio.gather(*(d.process.stop() for d in self.devices), return_exceptions=True)
        await asyncio.gather(*(n.process.stop() for n in self.nodes), return_exceptions=True)
        for node in self.nodes:
            if node.redis_link is not None:
                await node.redis_link.aclose()
