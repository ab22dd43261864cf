"""A minimal raw HTTP/1.1 client for the benches, costing the client what it costs every anchor: requests as bytes
(`request_bytes`), one response read whole or chunked (`read_response`), callers in a closed loop (`closed_loop`)
or one trip at a time (`sequential`) on keep-alive connections, and what they saw (`Tally`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import psutil

from bench.kit.procs.cpu import cpu_exact_s


@dataclass
class Tally:
    """What the callers saw: answers, failures (a few kept) and chunked answers."""

    answers: int = 0
    chunked: int = 0
    failed: int = 0
    examples: list[str] = field(default_factory=list)


def request_bytes(path: str, token: str | None, body: bytes) -> bytes:
    """One HTTP/1.1 POST of the JSON `body` to `path`, with `token` as its Bearer token when given."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """One HTTP/1.1 response: (status, body, whether it came chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        return status, await reader.readexactly(int(headers["content-length"])), False
    body = bytearray()
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return status, bytes(body), True
        body += await reader.readexactly(size)
        await reader.readexactly(2)


def _check(status: int, body: bytes, tally: Tally, expect: bytes) -> None:
    if status != 200 or expect not in body:
        tally.failed += 1
        if len(tally.examples) < 3:
            tally.examples.append(f"{status} {body[:300]!r}")


async def caller(port: int, requests: list[bytes], until: float, tally: Tally, expect: bytes) -> int:
    """One closed-loop caller on a keep-alive connection of its own: `requests` in turn until `until`
    (`time.perf_counter`), each answer counted in `tally` (a failure unless 200 with `expect` in its body);
    returns how many it made."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
    done = 0
    try:
        while time.perf_counter() < until:
            writer.write(requests[done % len(requests)])
            status, body, chunked = await asyncio.wait_for(read_response(reader), 60)
            tally.chunked += chunked
            _check(status, body, tally, expect)
            done += 1
    finally:
        writer.close()
    tally.answers += done
    return done


async def closed_loop(port: int, requests: list[list[bytes]], seconds: float, procs: list[psutil.Process],
                      tally: Tally, expect: bytes) -> tuple[float, list[float]]:
    """(answers per second, CPU seconds per answer of each of `procs`) of `len(requests)` callers."""
    cpu0, t0 = [cpu_exact_s(p) for p in procs], time.perf_counter()
    counts = await asyncio.gather(*(caller(port, r, t0 + seconds, tally, expect) for r in requests))
    elapsed = time.perf_counter() - t0
    total = max(sum(counts), 1)
    return sum(counts) / elapsed, [(cpu_exact_s(p) - c) / total for p, c in zip(procs, cpu0, strict=True)]


async def sequential(port: int, request: bytes, n: int, tally: Tally, expect: bytes) -> list[float]:
    """`n` round trips, one at a time on one keep-alive connection: each one's seconds."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
    samples = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            writer.write(request)
            status, body, chunked = await asyncio.wait_for(read_response(reader), 60)
            samples.append(time.perf_counter() - t0)
            tally.chunked += chunked
            tally.answers += 1
            _check(status, body, tally, expect)
    finally:
        writer.close()
    return samples
