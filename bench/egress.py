"""What the egress proxy costs: fetching a local 1 MiB file through it against fetching it directly.

    python -m bench.egress [ROUNDS] [REPEATS]

An HTTP server in its own process serves 1 MiB on 127.0.0.1. In one run, interleaved round by round so
machine noise hits every row alike, `REPEATS` times over (a median per repeat; the spread is the
range of those medians):

- a client in its own process (blocking sockets, timing itself from connect to the last byte): the
  file fetched directly, and through the proxy with HTTP CONNECT, a plain forward-proxy GET and
  SOCKS5 (remote name), and CONNECT again with the relay copying through a buffer instead of
  splice(2). This isolates the proxy's own cost;
- each row's CPU in this process per fetch ("CPU here": the proxy's event loop for the proxied client rows,
  the device's side of the sandbox for curl's), which a busy machine moves far less than wall time;
- curl inside a real sandbox, as a command would fetch it: with `network: on` (straight to the
  server) and with `network: {allow: [...]}` (no network of its own: the proxy, through the port the
  warden opened and handed to the device). Each row includes curl's start and the sandbox's fork.

Goal (issue 26): through the proxy <= 1.2x direct.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench._stats import spread

SIZE = 1 << 20
ROUNDS = 40
REPEATS = 3
WARMUP = 3

SERVER = r"""
import socket, sys, threading
body = b"x" * int(sys.argv[1])
head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
srv = socket.create_server(("127.0.0.1", 0), backlog=128)
print(srv.getsockname()[1], flush=True)
def serve(conn):
    with conn:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        conn.sendall(head + body)
while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""

# one line per fetch on stdin: "MODE PROXYPORT", answered with the seconds it took
CLIENT = r"""
import socket, sys, time
server, size = int(sys.argv[1]), int(sys.argv[2])
def read_all(sock):
    got = 0
    while chunk := sock.recv(1 << 20):
        got += len(chunk)
    return got
def head(sock):
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    return data
for line in sys.stdin:
    mode, proxy = line.split()
    start = time.perf_counter()
    if mode == "direct":
        sock = socket.create_connection(("127.0.0.1", server))
        sock.sendall(b"GET /f HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    else:
        sock = socket.create_connection(("127.0.0.1", int(proxy)))
        if mode == "connect":
            sock.sendall(b"CONNECT 127.0.0.1:%d HTTP/1.1\r\n\r\n" % server)
            assert b" 200 " in head(sock)
            sock.sendall(b"GET /f HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        elif mode == "http":
            sock.sendall(b"GET http://127.0.0.1:%d/f HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" % server)
        else:
            sock.sendall(b"\x05\x01\x00")
            assert sock.recv(2) == b"\x05\x00"
            sock.sendall(b"\x05\x01\x00\x03\x09127.0.0.1" + server.to_bytes(2, "big"))
            reply = b""
            while len(reply) < 10:
                reply += sock.recv(10 - len(reply))
            assert reply[1] == 0, reply
            sock.sendall(b"GET /f HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    got = read_all(sock)
    sock.close()
    elapsed = time.perf_counter() - start
    assert got > size, got
    print(elapsed, flush=True)
"""


async def main(rounds: int = ROUNDS, repeats: int = REPEATS) -> dict[str, float]:
    from tether.sandbox import SandboxSpec, detect
    from tether.sandbox.egress.proxy import EgressProxy, Limits
    from tether.sandbox.egress.rules import EgressRules
    from tether.sandbox.runner import Sandbox

    curl = shutil.which("curl")
    if curl is None:
        sys.exit("curl is not installed: apt-get install -y curl")
    curl = os.path.realpath(curl)
    info = detect()
    if not info.available:
        sys.exit(f"no sandbox here: {info.detail}")
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(SIZE)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    client = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, str(port), str(SIZE),
                                                  stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert client.stdin is not None and client.stdout is not None
    rules = EgressRules.build(allow=[f"127.0.0.1:{port}"])
    proxy, copying = EgressProxy(rules), EgressProxy(rules, limits=Limits(splice=False))
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    proxy_port = listener.getsockname()[1]
    proxy.serve(listener)
    copy_listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    copy_port = copy_listener.getsockname()[1]
    copying.serve(copy_listener)
    work = Path(tempfile.mkdtemp(prefix="tether-bench-egress-"))
    boxes: list[Sandbox] = []
    for network in (True, False):
        layers = work / f"layers-{network}"
        spec = SandboxSpec.build(write_roots=[], network=network, layers_dir=str(layers))
        boxes.append(Sandbox(info, spec, egress=None if network else rules))
    direct_box, proxied_box = boxes

    async def fetch(mode: str, through: int = proxy_port) -> float:
        client.stdin.write(f"{mode} {through}\n".encode())  # type: ignore[union-attr]
        async with asyncio.timeout(30):
            line = await client.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError("the client process died")
        return float(line)

    async def sandboxed(box: Sandbox) -> float:
        start = time.perf_counter()
        env = {"PATH": "/usr/bin:/bin"}
        argv = [curl, "-sS", "-o", "/dev/null", "-w", "%{size_download}", f"http://127.0.0.1:{port}/f"]
        proc = await box.spawn(argv, executable=curl, cwd="/", env=env, stdin=False, layer=None)
        assert proc.stdout is not None and proc.stderr is not None
        async with asyncio.timeout(30):
            out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
            code = await proc.wait()
        if code != 0 or int(out or 0) != SIZE:
            raise RuntimeError(f"curl in the sandbox failed ({code}): {err.decode()} {out.decode()}")
        return time.perf_counter() - start

    rows: dict[str, Callable[[], Awaitable[float]]] = {
        "client process, direct": lambda: fetch("direct"),
        "client process, proxy CONNECT": lambda: fetch("connect"),
        "client process, proxy CONNECT, copying relay": lambda: fetch("connect", copy_port),
        "client process, proxy HTTP forward": lambda: fetch("http"),
        "client process, proxy SOCKS5": lambda: fetch("socks"),
        "curl in the sandbox, network: on (direct)": lambda: sandboxed(direct_box),
        "curl in the sandbox, network: {allow} (proxy)": lambda: sandboxed(proxied_box),
    }
    medians: dict[str, list[float]] = {name: [] for name in rows}
    cpu: dict[str, float] = dict.fromkeys(rows, 0.0)  # this process's CPU (the proxy's event loop) per row
    try:
        for _ in range(repeats):
            samples: dict[str, list[float]] = {name: [] for name in rows}
            for i in range(-WARMUP, rounds):
                for name, run in rows.items():
                    cpu_before = time.process_time()
                    elapsed = await run()
                    if i >= 0:
                        samples[name].append(elapsed)
                        cpu[name] += time.process_time() - cpu_before
            for name, values in samples.items():
                medians[name].append(statistics.median(values) * 1000)
    finally:
        client.stdin.close()
        await client.wait()
        server.kill()
        server.wait()
        await proxy.aclose()
        await copying.aclose()
        for box in boxes:
            await box.aclose()
        shutil.rmtree(work, ignore_errors=True)

    print(f"egress proxy cost: 1 MiB over 127.0.0.1, {repeats} repeats of {rounds} interleaved rounds "
          f"(+{WARMUP} warm-up), {os.cpu_count()} CPUs")
    result: dict[str, float] = {}
    for name, values in medians.items():
        result[name] = statistics.median(values)
        print(f"{name:<50} median {result[name]:8.3f} ms   spread of repeat medians {spread(values)} ms   "
              f"CPU here {cpu[name] / (rounds * repeats) * 1000:6.3f} ms/fetch")
    print()
    pairs = (("client process, direct", "client process, proxy CONNECT"),
             ("client process, direct", "client process, proxy HTTP forward"),
             ("client process, direct", "client process, proxy SOCKS5"),
             ("client process, direct", "client process, proxy CONNECT, copying relay"),
             ("curl in the sandbox, network: on (direct)", "curl in the sandbox, network: {allow} (proxy)"))
    for direct, through in pairs:
        ratio = result[through] / result[direct]
        print(f"ratio {through} / {direct}: {ratio:.2f}x (goal <= 1.2x: {'within' if ratio <= 1.2 else 'OVER'})")
        result[f"ratio: {through}"] = ratio
    return result


if __name__ == "__main__":
    asyncio.run(main(*(int(a) for a in sys.argv[1:3])))
