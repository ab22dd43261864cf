"""Clustered `tether server` nodes for the cluster benches: a private `redis-server`, nodes sharing one
database (and Redis, when clustered), their device processes (`python -m bench.cluster --peer`, up to
`PER_PROCESS` devices each) and one HTTP client per node.

A heartbeat of 5 s / timeout 15 s / grace 10 s (the server's defaults, `HEARTBEAT`) is used throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.kit.procs.fleet import free_port, stop_process

WAIT = 120.0

HEARTBEAT = {"interval": 5.0, "timeout": 15.0, "grace": 10.0}  # the server's defaults

PER_PROCESS = 250


class Child:
    """A child process whose output lines are read as they come (and copied to a log file)."""

    def __init__(self, label: str, log: Path) -> None:
        self.label = label
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: asyncio.Queue[str | None] = asyncio.Queue()  # None: the process's output ended
        self._reader: asyncio.Task[None] | None = None
        self.stdin_data: bytes | None = None

    async def start(self, argv: Sequence[str], env: dict[str, str], stdin: bytes | None = None) -> Child:
        """Start `argv` with `env`, its output read line by line into `lines` (and the log); `stdin`, when
        given, is written and the pipe kept open (its end tells a device process to stop). Returns self."""
        self.proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env, limit=1 << 20,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL)
        if stdin is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(stdin)
            await self.proc.stdin.drain()  # stdin stays open: its end tells a device process to stop
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.log.open("a", encoding="utf-8") as out:
            while raw := await self.proc.stdout.readline():
                line = raw.decode(errors="replace").rstrip("\n")
                out.write(line + "\n")
                self.lines.put_nowait(line)
        self.lines.put_nowait(None)

    async def until(self, pattern: str, timeout: float = WAIT) -> re.Match[str]:
        """The first output line matching `pattern`; RuntimeError when the process's output ends first,
        TimeoutError after `timeout` s."""
        regex = re.compile(pattern)
        async with asyncio.timeout(timeout):
            while True:
                line = await self.lines.get()
                if line is None:
                    raise RuntimeError(f"{self.label} exited before /{pattern}/; see {self.log}")
                if match := regex.search(line):
                    return match

    async def stop(self) -> None:
        """Close its stdin, stop the process (`stop_process`) and wait for its reader to end."""
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()
        await stop_process(self.proc)
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 10)


@asynccontextmanager
async def redis_server(tmp: Path) -> AsyncIterator[int]:
    """A private redis-server on a free port (no persistence); yields its port."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed; install it with: apt-get install -y redis-server")
    port = free_port()
    child = Child("redis-server", tmp / "redis.log")
    await child.start([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                       "--dir", str(tmp)], dict(os.environ))
    try:
        await child.until("Ready to accept connections", 30)
        yield port
    finally:
        await child.stop()


def _env(state: Path) -> dict[str, str]:
    env = {**os.environ, "TETHER_STATE_DIR": str(state), "NO_COLOR": "1"}
    for name in ("TETHER_LLM_BASE_URL", "TETHER_LLM_MODEL", "TETHER_CLUSTER", "TETHER_DB_URL", "TETHER_DEVICE_TOKEN"):
        env.pop(name, None)
    return env


async def admin_token(tmp: Path, db: str) -> str:
    """An API token made with `tether token create` in the (shared) database before any node starts."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether.cli", "token", "create", "--api", "bench", "--scope", "read", "--scope",
        "execute", "--scope", "admin", "--db", db, "--json", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=_env(tmp))
    out, err = await asyncio.wait_for(proc.communicate(), WAIT)
    if proc.returncode != 0:
        raise RuntimeError(f"tether token create failed: {err.decode(errors='replace')}")
    return json.loads(out)["token"]


@dataclass
class Node:
    """One `tether server` node: its name, port and process."""

    name: str
    port: int
    child: Child

    @property
    def url(self) -> str:
        """The node's HTTP base URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        """The node's AIP WebSocket URL."""
        return f"ws://127.0.0.1:{self.port}/aip"


@dataclass
class Setup:
    """Nodes sharing one database (and Redis, when clustered), their device processes and HTTP clients."""

    tmp: Path
    db: str
    redis_port: int | None
    token: str = ""
    nodes: list[Node] = field(default_factory=list)
    peers: list[Child] = field(default_factory=list)
    http: dict[str, httpx.AsyncClient] = field(default_factory=dict)
    holder: dict[str, str] = field(default_factory=dict)  # device -> ws URL it registered at last
    registered_at: dict[str, float] = field(default_factory=dict)  # device -> time.time() of that
    watchers: list[asyncio.Task[None]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    node_args: list[str] = field(default_factory=list)  # more `tether server` options for every node

    async def start_node(self, name: str) -> Node:
        """Start node `name` on a free port (clustered when `redis_port` is set) and wait until it serves;
        its HTTP client, with the admin token, is `http[name]`."""
        port = free_port()
        state = self.tmp / f"state-{name}"
        state.mkdir(parents=True, exist_ok=True)
        hb = HEARTBEAT
        argv = [sys.executable, "-m", "tether.cli", "server", "--port", str(port), "--db", self.db, "--log-level",
                "info", "--heartbeat-interval", str(hb["interval"]), "--heartbeat-timeout", str(hb["timeout"]),
                "--grace-period", str(hb["grace"])]
        if self.redis_port is not None:
            argv += ["--cluster", f"redis://127.0.0.1:{self.redis_port}/0", "--node-id", name]
        argv += self.node_args
        child = await Child(f"node {name}", self.tmp / f"node-{name}.log").start(argv, _env(state))
        await child.until("Uvicorn running on")
        node = Node(name, port, child)
        self.nodes.append(node)
        self.http[name] = httpx.AsyncClient(base_url=f"{node.url}/api/v1", timeout=httpx.Timeout(60, connect=10),
                                            headers={"Authorization": f"Bearer {self.token}"},
                                            limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))
        asyncio.create_task(self._drain(child))  # noqa: RUF006 - ends with the process; keeps its pipe empty
        return node

    @staticmethod
    async def _drain(child: Child) -> None:
        while await child.lines.get() is not None:
            pass

    async def device_tokens(self, names: list[str]) -> dict[str, str]:
        """A device token for each of `names`, created through the first node; RuntimeError on a refusal."""
        http = self.http[self.nodes[0].name]
        tokens: dict[str, str] = {}
        for start in range(0, len(names), 64):
            chunk = names[start:start + 64]
            answers = await asyncio.gather(*(http.post("/tokens", json={"kind": "device", "name": n})
                                             for n in chunk))
            for name, answer in zip(chunk, answers, strict=True):
                if answer.status_code != 201:
                    raise RuntimeError(f"token for {name}: {answer.status_code} {answer.text}")
                tokens[name] = answer.json()["token"]
        return tokens

    async def start_devices(self, names: list[str], *, spread_over: list[Node]) -> None:
        """Device i is given node i mod len(spread_over) first, then the others in turn."""
        tokens = await self.device_tokens(names)
        n = len(spread_over)
        plan = {name: [tokens[name], [spread_over[(i + k) % n].ws_url for k in range(n)]]
                for i, name in enumerate(names)}
        groups = [names[i:i + PER_PROCESS] for i in range(0, len(names), PER_PROCESS)]
        for index, group in enumerate(groups):
            child = Child(f"devices {index}", self.tmp / f"devices-{len(self.peers)}.log")
            await child.start([sys.executable, "-m", "bench.cluster", "--peer", str(self.tmp / "devices")],
                              _env(self.tmp), stdin=json.dumps({n: plan[n] for n in group}).encode() + b"\n")
            self.peers.append(child)
            await self._until_ready(child, len(group))
            self.watchers.append(asyncio.create_task(self._watch(child)))

    async def _until_ready(self, child: Child, count: int) -> None:
        async with asyncio.timeout(WAIT * 3):
            while True:
                line = await child.lines.get()
                if line is None:
                    raise RuntimeError(f"a device process exited early; see {child.log}")
                self._note(line)
                if line == f"ready {count}":
                    return

    def _note(self, line: str) -> None:
        if line.startswith("reg "):
            _, name, url, at = line.split(" ")
            self.holder[name], self.registered_at[name] = url, float(at)
            self.changed.set()

    async def _watch(self, child: Child) -> None:
        while (line := await child.lines.get()) is not None:
            self._note(line)

    async def aclose(self) -> None:
        """Stop the watchers, the device processes, the HTTP clients and the nodes."""
        for task in self.watchers:
            task.cancel()
        for child in self.peers:
            await child.stop()
        for client in self.http.values():
            await client.aclose()
        await asyncio.gather(*(node.child.stop() for node in self.nodes))
