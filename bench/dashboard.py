"""The dashboard: how soon a device's state change reaches it, with many devices connected, and how
much its first load weighs.

    python -m bench.dashboard [--devices N] [--rounds R]

A real `tether server` process (SQLite in a temp directory) with N devices connected (default 1,000,
as bench/load.py): raw AIP WebSocket clients in this process, each registered with its own device
token. A session logs in at /web/login as the page does and reads the fleet stream (/web/fleet, SSE)
as the page's EventSource does. Each round one device reports itself busy (a heartbeat with
running=1), then idle again: the subject is the time from sending that heartbeat to the stream's
`device` frame showing the new state.

Then the same in the dashboard itself (Chromium, the devices table), R rounds more.

Anchor, in the same round from the same send: the server's heartbeat reply on the device's own socket
(one hop in, one out, no dashboard at all), so the ratio is what the fleet stream adds.

First-load size: the bytes of `/` plus the scripts and styles it loads (uncompressed), against the
issue's goal of 200 KB; anchor: the same for `/docs` (Swagger UI).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from websockets.asyncio.client import ClientConnection, connect

from bench._stats import pct
from bench.kit.procs.fleet import free_port, raise_fd_limit, server_process
from tether.device.link.trust.device_key import DeviceKey
from tether.protocol.codec import decode_server_message, encode
from tether.protocol.identity import CHALLENGE_HEADER
from tether.protocol.messages import ClientMessage, ClientMessageType, Registration, ServerMessageType
from tether.protocol.profile import DeviceProfile
from tether.server.store import Store

WAIT_S = 60.0
SERVER_ARGS = ("--heartbeat-interval", "5", "--heartbeat-timeout", "3600")  # the probe's heartbeats, no timeouts


async def register(url: str, name: str, token: str) -> ClientConnection:
    ws = await connect(url, additional_headers={"Authorization": f"Bearer {token}"}, ping_interval=None,
                       max_size=None, open_timeout=WAIT_S)
    instance = uuid.uuid4().hex
    challenge = ws.response.headers.get(CHALLENGE_HEADER)  # signed with a key of its own: enrolled on first use
    proof = DeviceKey.generate().register_proof(challenge, name, instance) if challenge else None
    reg = Registration(name=name, instance_id=instance, profile=DeviceProfile(), proof=proof)
    await ws.send(encode(ClientMessage(type=ClientMessageType.REGISTER, payload=reg.model_dump(
        exclude={"proof"} if proof is None else None))))
    answer = decode_server_message(await asyncio.wait_for(ws.recv(), WAIT_S), 1 << 30)
    if answer.type is not ServerMessageType.REGISTER_ACK:
        raise RuntimeError(f"{name} was not registered: {answer}")
    return ws


class Fleet:
    """The fleet stream as the page reads it: frames parsed, each `device` row handed to a waiter."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.first: asyncio.Future[list[dict]] = asyncio.get_running_loop().create_future()
        self.waiting: dict[tuple[str, int], asyncio.Future[float]] = {}

    async def read(self) -> None:
        event = ""
        async for line in self.response.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                now = time.perf_counter()
                if event == "devices" and not self.first.done():
                    self.first.set_result(data)
                elif event == "device":
                    waiter = self.waiting.pop((data["name"], data["running"]), None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(now)


# resolves once the row's "load / running" cell ends with the wanted count; woken by DOM mutations
SHOWN_JS = """([sel, want]) => new Promise((done) => {
  const shown = () => {
    const r = document.querySelector(sel);
    return r && r.cells[5].textContent.endsWith(' / ' + want);
  };
  if (shown()) return done();
  new MutationObserver((_, watch) => { if (shown()) { watch.disconnect(); done(); } })
    .observe(document.querySelector('tbody'), {childList: true, subtree: true, characterData: true});
})"""


async def browser_rounds(port: int, token: str, probe: ClientConnection, name: str, rounds: int) -> list[float]:
    """The dashboard itself, in the system Chromium: from the heartbeat's send to the device's row in the
    page's table showing the new load (waited for on DOM mutations, not by polling)."""
    from playwright.async_api import async_playwright

    from tether.tools.browser.session import find_chromium

    samples: list[float] = []
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=find_chromium(), args=["--no-sandbox"])
        try:
            page = await browser.new_page()
            await page.goto(f"http://127.0.0.1:{port}/")
            await page.get_by_label("API token").fill(token)
            await page.get_by_role("button", name="Log in").click()
            row = f'tr[data-device="{name}"]'
            await page.wait_for_selector(row, timeout=WAIT_S * 1000)
            for r in range(rounds):
                running = 1 - r % 2
                shows = asyncio.ensure_future(page.evaluate(SHOWN_JS, [row, running]))
                await asyncio.sleep(0)  # let the wait be sent to the page first
                sent = time.perf_counter()
                await probe.send(encode(ClientMessage(type=ClientMessageType.HEARTBEAT,
                                                      payload={"running": running})))
                await shows
                samples.append(time.perf_counter() - sent)
                while True:  # its heartbeat reply, so the next round starts clean
                    reply = decode_server_message(await asyncio.wait_for(probe.recv(), WAIT_S), 1 << 30)
                    if reply.type is ServerMessageType.HEARTBEAT:
                        break
        finally:
            await browser.close()
    return samples


async def first_load(http: httpx.AsyncClient, page: str) -> int:
    """Bytes of the page and every script and stylesheet it names."""
    import re

    html = (await http.get(page)).content
    total = len(html)
    for ref in re.findall(rb'(?:src|href)="(/web/static/[^"]+\.(?:js|css))"', html):
        total += len((await http.get(ref.decode())).content)
    return total


async def main(n_devices: int, rounds: int) -> int:
    raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="tether-bench-dash-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "state").mkdir()
        store = Store(str(tmp / "server.db"))
        tokens = {f"dash-{i:04d}": store.tokens.create("device", f"dash-{i:04d}", [])[1] for i in range(n_devices)}
        _, api_token = store.tokens.create("api", "bench", ["read"])
        store.close()
        port = free_port()
        url = f"ws://127.0.0.1:{port}/aip"
        async with server_process(tmp, port, args=SERVER_ARGS), httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                                                timeout=WAIT_S) as http:
            started = time.perf_counter()
            sockets: list[ClientConnection] = []
            names = list(tokens)
            for i in range(0, n_devices, 100):  # in waves, so the server's accept queue is not the subject
                sockets += await asyncio.gather(*(register(url, n, tokens[n]) for n in names[i:i + 100]))
            print(f"{n_devices} devices connected in {time.perf_counter() - started:.1f} s")
            login = await http.post("/web/login", json={"token": api_token})
            login.raise_for_status()
            async with http.stream("GET", "/web/fleet", cookies=login.cookies) as response:
                fleet = Fleet(response)
                reader = asyncio.create_task(fleet.read())
                rows = await asyncio.wait_for(fleet.first, WAIT_S)
                print(f"fleet stream's first frame: {len(rows)} rows")
                subject: list[float] = []
                anchor: list[float] = []
                probe, name = sockets[n_devices // 2], names[n_devices // 2]
                for r in range(rounds):
                    running = 1 - r % 2  # busy, idle, busy, ...
                    shown = fleet.waiting[(name, running)] = asyncio.get_running_loop().create_future()
                    sent = time.perf_counter()
                    await probe.send(encode(ClientMessage(type=ClientMessageType.HEARTBEAT,
                                                          payload={"running": running})))
                    while True:  # the heartbeat reply on the device's socket
                        reply = decode_server_message(await asyncio.wait_for(probe.recv(), WAIT_S), 1 << 30)
                        if reply.type is ServerMessageType.HEARTBEAT:
                            anchor.append(time.perf_counter() - sent)
                            break
                    subject.append(await asyncio.wait_for(shown, WAIT_S) - sent)
                reader.cancel()
            shown_in_page = await browser_rounds(port, api_token, sockets[0], names[0], rounds)
            for ws in sockets:
                await ws.close()
            dash = await first_load(http, "/")
            docs = await first_load(http, "/docs")
    ms = 1000.0
    print(f"\nstate change -> dashboard (fleet SSE frame), {n_devices} devices, {rounds} rounds")
    print(f"  subject  p50 {pct(subject, 50) * ms:7.2f} ms  p99 {pct(subject, 99) * ms:7.2f} ms  "
          f"spread (IQR) {(pct(subject, 75) - pct(subject, 25)) * ms:.2f} ms   goal p99 <= 500 ms")
    print(f"  anchor   p50 {pct(anchor, 50) * ms:7.2f} ms  p99 {pct(anchor, 99) * ms:7.2f} ms  "
          "(the heartbeat's own reply on the device socket)")
    print(f"  ratio of medians {statistics.median(subject) / statistics.median(anchor):.1f}x")
    print(f"  page     p50 {pct(shown_in_page, 50) * ms:7.2f} ms  p99 {pct(shown_in_page, 99) * ms:7.2f} ms  "
          "(the same change seen in the dashboard's table in Chromium, a MutationObserver wait)")
    print(f"\nfirst load: dashboard {dash / 1024:.1f} KB (goal <= 200 KB); anchor /docs {docs / 1024:.1f} KB "
          f"({dash / docs:.3f}x)")
    return 0 if max(pct(subject, 99), pct(shown_in_page, 99)) <= 0.5 and dash <= 200 * 1024 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    raise SystemExit(asyncio.run(main(args.devices, args.rounds)))
