"""Real `tether device` processes as a user starts them, for the benches: their environment and config
(`device_env`), and one process per token, yielded once the server lists them all online (`real_devices`)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import psutil

from bench.kit.procs.fleet import stop_process

DEVICE_START_S = 120.0  # all device processes registered within this, or the run fails


def device_env(tmp: Path) -> tuple[dict[str, str], list[str]]:
    """The environment (no TETHER_* of the caller's but TETHER_ALLOW_ROOT; a config in `tmp` with the files and
    system tools) and the extra argv (`--allow-root` as root) a bench's `tether device` processes start with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_") or k == "TETHER_ALLOW_ROOT"}
    env.update(NO_COLOR="1", TETHER_CONFIG=str(tmp / "device.yaml"))
    (tmp / "device.yaml").write_text("device:\n  builtin: [files, system]\n")
    return env, ["--allow-root"] if os.geteuid() == 0 else []


@asynccontextmanager
async def real_devices(tmp: Path, port: int, tokens: dict[str, str], api: str, cprofile: Path | None = None,
                       base: Path | None = None) -> AsyncIterator[list[psutil.Process]]:
    """One `tether device` process per token, as a user starts it; yields once the server lists them all online.
    With `cprofile`, the first runs under cProfile, which writes its figures there when it stops; with `base`
    (another checkout's `src`), every second one runs that tree."""
    env, argv_root = device_env(tmp)
    procs: list[asyncio.subprocess.Process] = []
    try:
        for i, (name, token) in enumerate(tokens.items()):
            profiled = ["-m", "bench.kit.cpu_profile", str(cprofile)] if cprofile is not None and i == 0 else []
            (tmp / name).mkdir()
            (tmp / name / "token").write_text(token)
            tree = {**env, "PYTHONPATH": str(base)} if base is not None and i % 2 else env
            with (tmp / f"{name}.log").open("wb") as log:
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, *(profiled or ["-m"]), "tether.cli", "device", "--server", f"ws://127.0.0.1:{port}/aip",
                    "--name", name, "--token-file", str(tmp / name / "token"), "--state-dir", str(tmp / name),
                    *argv_root, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=tree))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                     headers={"Authorization": f"Bearer {api}"}) as http:
            deadline = time.monotonic() + DEVICE_START_S
            while True:  # no event for "registered" across processes: the server's own count
                answer = await http.get("/api/v1/health")
                online = answer.json()["devices_online"] if answer.status_code == 200 else 0
                if online >= len(tokens):
                    break
                for proc, name in zip(procs, tokens, strict=True):
                    if proc.returncode is not None:
                        raise RuntimeError(f"tether device {name} exited {proc.returncode}: "
                                           f"{(tmp / f'{name}.log').read_text(errors='replace')[-1500:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{online} of {len(tokens)} devices online after {DEVICE_START_S:g} s")
                await asyncio.sleep(0.1)
        yield [psutil.Process(p.pid) for p in procs]
    finally:
        for proc in procs:
            await stop_process(proc, grace=15)
