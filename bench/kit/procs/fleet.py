"""A fleet of real device processes and a real server process for the benches: `server_process` (`tether server`
on a port, ready once /api/v1/health answers), `device_process` / `start_fleet` (client processes each running
many of tether's own `DeviceConnection`s, registered with their own device tokens, handed over on stdin),
and the helpers around them (free ports, stopping processes, the file-descriptor limit, CPU seconds).

    python -m bench.kit.procs.fleet --peer devices URL STATE   (a client process, as `device_process` starts it)
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import resource
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import psutil

STUCK = "load-0000"
CHEAP = {"tool_name": "list_tools", "tool_type": "data_collection", "parameters": {"namespace": "bench-none"}}


async def stop_process(proc: asyncio.subprocess.Process, grace: float = 30.0) -> None:
    """Terminate a process the bench started, and kill it if it has not ended within `grace` seconds."""
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@contextlib.contextmanager
def tree(src: Path | None) -> Iterator[None]:
    """Processes started meanwhile import tether from `src` (None: this tree's)."""
    old = os.environ.get("PYTHONPATH")
    if src is not None:
        os.environ["PYTHONPATH"] = str(src)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def device_name(i: int) -> str:
    return f"load-{i:04d}"


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else 1 << 20
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def devices_main(url: str, state_root: str) -> None:
    """`--peer devices URL STATE`: the devices whose tokens arrive as one JSON line on stdin, until EOF."""
    from tether.device.config import parse_device_config
    from tether.device.link.connection import DeviceConnection, LinkSettings
    from tether.device.local import build_device
    from tether.protocol.models import Command

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    loop = asyncio.get_running_loop()
    tokens: dict[str, str] = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
    stop = asyncio.Event()
    eof = loop.run_in_executor(None, sys.stdin.buffer.read)
    eof.add_done_callback(lambda _: loop.call_soon_threadsafe(stop.set))
    devices, links, tasks = [], [], []
    try:
        names = sorted(tokens)
        for start in range(0, len(names), 50):  # in waves, so the server's accept queue stays short
            wave = []
            for name in names[start:start + 50]:
                stuck = name == STUCK  # the one that runs a real (sandboxed) shell.run
                config = parse_device_config({"device": {"name": name,
                                                         "builtin": ["shell", "system"] if stuck else ["system"]}})
                device = build_device(config, state_dir=Path(state_root) / name, client_id=name,
                                      serving=stuck, sandbox=stuck)
                # its first call builds the device's meta tools (~6 ms of pydantic models): paid here, paced by
                # the waves, not by 250 devices at once in the first fan-out while their heartbeats wait
                await device.client.execute_actions([Command.model_validate(CHEAP)])
                link = DeviceConnection(device.client, url, tokens[name], name=name,
                                        settings=LinkSettings(connect_timeout=60))
                devices.append(device)
                links.append(link)
                tasks.append(asyncio.create_task(link.run()))
                wave.append(link)
            await asyncio.wait_for(asyncio.gather(*(link.connected.wait() for link in wave)), 120)
        gc.freeze()  # hundreds of idle connections: keep them out of this process's full collections too
        print(f"ready {len(links)}", flush=True)
        await stop.wait()
    finally:
        for link in links:
            link.stop()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        for device in devices:
            await device.aclose()


@asynccontextmanager
async def device_process(url: str, state_root: Path, tokens: dict[str, str], log: Path,
                         nice: int = 0) -> AsyncIterator[int]:
    """A client process running `tokens`' devices; yields its pid once all of them are registered. `nice`
    lowers its scheduling priority (see `DEVICE_NICE`)."""
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.kit.procs.fleet", "--peer", "devices",
                                                    url, str(state_root), stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, stderr=err,
                                                    preexec_fn=(lambda: os.nice(nice)) if nice else None)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(tokens).encode() + b"\n")
            await proc.stdin.drain()
            line = await asyncio.wait_for(proc.stdout.readline(), 300)
            if not line.startswith(b"ready"):
                raise RuntimeError(f"a device process failed before its devices registered; see {log}:\n"
                                   f"{log.read_text(errors='replace')[-2000:]}")
            yield proc.pid
        finally:
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()


START_AT_ONCE = 4  # device processes starting at once: 40 importing tether together starve 2 cores
# A fleet's devices run on their own machines; here 10,000 of them share the server's 2 cores in 40 processes,
# and at equal priority the kernel gives each process an equal share whenever they are all busy: during a
# server outage their retries (~4 cores' worth of demand at 10,000) left the restarted server ~1/20 of a
# core, and its imports ran at ~10% speed (py-spy). At nice 10 the server runs first and the devices use
# what it leaves. The fleet benchmarks print the value they ran with.
DEVICE_NICE = 10


async def start_fleet(stack: contextlib.AsyncExitStack, url: str, state_root: Path, tokens: dict[str, str],
                      per_process: int, logs: Path, at_once: int = START_AT_ONCE, nice: int = 0) -> list[int]:
    """Every device of `tokens`, `per_process` to a client process, registered; returns the processes' pids.
    At most `at_once` processes are starting (importing, building and registering their devices) at any
    time, and the next one starts as soon as one is ready: a pipeline, not rounds waiting for the slowest."""
    names = sorted(tokens)
    groups = [names[i:i + per_process] for i in range(0, len(names), per_process)]
    gate = asyncio.Semaphore(at_once)

    async def one(i: int, group: list[str]) -> int:
        async with gate:
            return await stack.enter_async_context(device_process(url, state_root, {n: tokens[n] for n in group},
                                                                  logs / f"devices-{i}.log", nice))

    return list(await asyncio.gather(*(one(i, group) for i, group in enumerate(groups))))


@asynccontextmanager
async def server_process(tmp: Path, port: int, profile: Path | None = None, *, db: str | None = None,
                         args: tuple[str, ...] = (), label: str = "server", ready_s: float = 30.0,
                         log_level: str = "warning") -> AsyncIterator[psutil.Process]:
    """`tether server` on `port` with its state in `tmp` (its log: `tmp/server.log`, at `log_level`; at `info`, as
    `tether server` runs by default, one access line per request) and its database `db` (a SQLite path or a
    PostgreSQL URL; default `tmp/server.db`), `args` more `tether server` options; yields once /api/v1/health
    answers, RuntimeError (naming it by `label`, with its log's tail) when it exits first or does not answer
    within `ready_s`. With `profile`, it runs under cProfile on its CPU clock (`bench.kit.cpu_profile`), which
    writes there when it stops."""
    state = tmp / "state"
    state.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TETHER_STATE_DIR": str(state), "NO_COLOR": "1"}
    env.pop("TETHER_LLM_BASE_URL", None)
    log_path = tmp / "server.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *(["-m", "bench.kit.cpu_profile", str(profile)] if profile is not None else ["-m"]),
            "tether.cli", "server", "--port", str(port), "--db", db or str(tmp / "server.db"),
            "--log-level", log_level, *args, stdout=log, stderr=log, env=env)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                for _ in range(round(ready_s / 0.05)):  # uvicorn offers no event for "started" across processes
                    if proc.returncode is not None:
                        raise RuntimeError(f"the {label} exited: {log_path.read_text()[-2000:]}")
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.get("/api/v1/health")).status_code == 200:
                            break
                    await asyncio.sleep(0.05)
                else:
                    raise RuntimeError(f"the {label} did not answer /api/v1/health within {ready_s:g} s")
            yield psutil.Process(proc.pid)
        finally:
            await stop_process(proc)


def free_port() -> int:
    """A port for a server process about to start, handed to no other process at once (`bench.kit.ports`)."""
    from bench.kit import ports

    return ports.free_port()


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


if __name__ == "__main__":
    if sys.argv[1:3] != ["--peer", "devices"]:
        sys.exit("usage: python -m bench.kit.procs.fleet --peer devices URL STATE (tokens on stdin)")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(devices_main(*sys.argv[3:5]))
