"""Files that travel between devices: MiB/s of one file sent device to device through the server.

    python -m bench.transfer [--mib 64] [--rounds 5] [--chunk-kib 512]

A real `tether server` and two real `tether device` processes (alpha, beta) on 127.0.0.1, SQLite in a temp
directory. Each round sends the same random file (`--mib`) from alpha to beta with `Client.transfer` (the
REST route, the server's transfer service, chunks over AIP, the sha256 checked on beta before the rename),
and, interleaved in a rotating order, the two anchors on the same file:
- `cp` of the file on this machine (the floor: one local copy, no network, no checksum);
- an HTTP download over loopback: `curl` fetching it from a `python -m http.server` process.
Printed: each one's median MiB/s with its spread over the rounds, and tether's ratio to each anchor.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from bench._stats import spread
from tether.client import Client

CLI = [sys.executable, "-m", "tether.cli"]


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


@contextlib.contextmanager
def _fleet(tmp: Path) -> Iterator[tuple[str, str, list[subprocess.Popen[bytes]]]]:
    from tether.server.store import Store

    state = tmp / "state"
    state.mkdir()
    store = Store(str(state / "server.db"))
    try:
        token = store.tokens.create("api", "bench", ["read", "execute", "approve", "admin"])[1]
        devices = {name: store.tokens.create("device", name, [])[1] for name in ("alpha", "beta")}
    finally:
        store.close()
    env = {**os.environ, "TETHER_STATE_DIR": str(state)}
    if os.geteuid() == 0:  # a device refuses root unless told (its sandboxed commands then run unprivileged)
        env["TETHER_ALLOW_ROOT"] = "1"
    policy = tmp / "policy.yaml"
    policy.write_text(f"write_roots: [{str(tmp)!r}]\n")
    port = _port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp / "procs.log").open("wb")
    procs = [subprocess.Popen([*CLI, "server", "--port", str(port), "--db", str(state / "server.db"),
                               "--log-level", "warning"], env=env, stdout=log, stderr=log)]
    headers = {"Authorization": f"Bearer {token}"}
    try:
        _wait(lambda: httpx.get(f"{url}/api/v1/health", headers=headers).status_code == 200, "the server")
        for name, secret in devices.items():
            procs.append(subprocess.Popen([*CLI, "device", "--server", f"ws://127.0.0.1:{port}", "--name", name,
                                           "--state-dir", str(tmp / f"dev-{name}"), "--policy", str(policy)],
                                          env={**env, "TETHER_DEVICE_TOKEN": secret}, stdout=log, stderr=log))
        _wait(lambda: {d["name"] for d in httpx.get(f"{url}/api/v1/devices", headers=headers).json()
                       if d["status"] == "online"} >= set(devices), "both devices online")
        yield url, token, procs
    except RuntimeError:
        log.flush()
        print((tmp / "procs.log").read_text(errors="replace")[-3000:], file=sys.stderr)
        raise
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-kib", type=int, default=768)
    args = parser.parse_args()
    if shutil.which("curl") is None:
        sys.exit("the HTTP anchor needs curl: apt-get install -y curl")
    with tempfile.TemporaryDirectory(prefix="tether-bench-transfer-") as tmp_name:
        tmp = Path(tmp_name)
        src = tmp / "payload.bin"
        with src.open("wb") as out:
            for _ in range(args.mib):
                out.write(os.urandom(1 << 20))
        http_port = _port()
        web = subprocess.Popen([sys.executable, "-m", "http.server", str(http_port), "--bind", "127.0.0.1",
                                "--directory", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait(lambda: httpx.head(f"http://127.0.0.1:{http_port}/payload.bin").status_code == 200, "http.server")
            with _fleet(tmp) as (url, token, _), Client(url, token, timeout=600) as client:

                def tether_round(n: int) -> float:
                    dest = tmp / f"tether-{n}.bin"
                    started = time.perf_counter()
                    result = client.transfer("alpha", str(src), "beta", str(dest), chunk_bytes=args.chunk_kib << 10)
                    took = time.perf_counter() - started
                    if not result.ok:
                        raise RuntimeError(f"the transfer failed: {result.error}")
                    dest.unlink()
                    return took

                def cp_round(n: int) -> float:
                    dest = tmp / f"cp-{n}.bin"
                    started = time.perf_counter()
                    subprocess.run(["cp", str(src), str(dest)], check=True)
                    took = time.perf_counter() - started
                    dest.unlink()
                    return took

                def http_round(n: int) -> float:
                    dest = tmp / f"http-{n}.bin"
                    started = time.perf_counter()
                    subprocess.run(["curl", "-sSf", "-o", str(dest), f"http://127.0.0.1:{http_port}/payload.bin"],
                                   check=True)
                    took = time.perf_counter() - started
                    dest.unlink()
                    return took

                runs: dict[str, tuple[Callable[[int], float], list[float]]] = {
                    "tether transfer alpha -> beta": (tether_round, []),
                    "anchor: cp on this machine": (cp_round, []),
                    "anchor: curl from http.server (loopback)": (http_round, [])}
                tether_round(-1)  # warm: imports, first connections
                names = list(runs)
                for n in range(args.rounds):
                    for name in names[n % 3:] + names[:n % 3]:  # a rotating order, interleaved
                        fn, samples = runs[name]
                        samples.append(args.mib / fn(n))
        finally:
            web.terminate()
            web.wait(15)
    print(f"{args.mib} MiB, {args.rounds} rounds, chunks of {args.chunk_kib} KiB (median MiB/s, spread min..max)")
    medians = {}
    for name, (_, samples) in runs.items():
        medians[name] = statistics.median(samples)
        print(f"  {name:<44} {medians[name]:8.1f} MiB/s   spread {spread(samples)}")
    subject = medians["tether transfer alpha -> beta"]
    for name in names[1:]:
        print(f"  tether / {name[len('anchor: '):]:<35} {subject / medians[name]:8.3f}x")


if __name__ == "__main__":
    main()
