"""Registration with the device-key proof against without it: server CPU per registration (issue 27).

Two real servers (`aip_route` + `DeviceHub` under uvicorn, one process each, SQLite state) run side by
side: `on` is the shipped code (every registration signs the connection's challenge and the server checks
it: one indexed read and one Ed25519 verification), `off` is the same code with `registration.prove_key`
taken out and devices that send no proof — registration as it was before the key. Rounds alternate
between the two (interleaved, so drift on a shared machine hits both alike); each round registers
`--devices` devices (`--concurrency` at a time: connect, REGISTER, the ack, close) and reads the server
process's CPU time (user+system) before and after. Reported: the median of the rounds' CPU ms per
registration for each, their spread (min..max), and the difference. Goal: at most +0.3 ms per
registration. Also printed: `prove_key` alone, timed in this process (the verification's own cost).

    python -m bench.registration_key [--devices 300] [--rounds 7] [--concurrency 25]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._stats import fleet_row, spread

GOAL_MS = 0.3


def key_for(name: str):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tether.device.link.trust.device_key import DeviceKey

    return DeviceKey(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"bench:{name}".encode()).digest()))


def serve(mode: str, db: str) -> None:
    """The server process: prints its port, serves until stdin closes."""
    import uvicorn
    from starlette.applications import Starlette

    import tether.server.aip.sockets.admission as admission_module
    from tether.server.aip.hub import DeviceHub
    from tether.server.aip.sockets.socket import aip_route
    from tether.server.settings import ServerSettings
    from tether.server.store import Store

    if mode == "off":  # registration as it was before the key: no proof asked, none checked
        admission_module.prove_key = lambda *args: None  # type: ignore[assignment]

    async def main() -> None:
        settings = ServerSettings(db_path=db, heartbeat_interval=30.0, heartbeat_timeout=120.0, grace_period=5.0,
                                  max_admitting=1024)
        store = Store(db)
        hub = DeviceHub(store, settings)
        await hub.start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        print(sock.getsockname()[1], flush=True)
        config = uvicorn.Config(Starlette(routes=[aip_route(hub)]), lifespan="off", log_config=None,
                                log_level="error", ws_ping_interval=None)
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
        await hub.aclose()
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        store.close()

    asyncio.run(main())


async def register_all(port: int, tokens: dict[str, str], prove: bool, concurrency: int) -> None:
    from websockets.asyncio.client import connect

    from tether.protocol.codec import decode_server_message, encode
    from tether.protocol.identity import CHALLENGE_HEADER
    from tether.protocol.messages import ClientMessage, ClientMessageType, Registration, ServerMessageType

    gate = asyncio.Semaphore(concurrency)
    keys = {name: key_for(name) for name in tokens}

    async def one(name: str) -> None:
        headers = {"Authorization": f"Bearer {tokens[name]}"}
        async with gate, connect(f"ws://127.0.0.1:{port}/aip", additional_headers=headers, ping_interval=None,
                                 open_timeout=60) as ws:
            instance = f"bench-{name}"  # the same process reconnecting: it replaces its last connection
            challenge = ws.response.headers.get(CHALLENGE_HEADER)
            proof = keys[name].register_proof(challenge, name, instance) if prove and challenge else None
            reg = Registration(name=name, instance_id=instance, proof=proof)
            await ws.send(encode(ClientMessage(type=ClientMessageType.REGISTER, payload=reg.model_dump(
                mode="json", exclude={"proof"} if proof is None else None))))
            answer = decode_server_message(await asyncio.wait_for(ws.recv(), 60), 1 << 24)
            if answer.type is not ServerMessageType.REGISTER_ACK:
                raise RuntimeError(f"{name}: {answer.error}")

    await asyncio.gather(*(one(name) for name in tokens))


def cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def prove_key_alone(samples: int = 2000) -> float:
    """Median µs of `registration.prove_key` for an enrolled device (an indexed read + one verification)."""
    from tether.protocol.messages import Registration
    from tether.server.aip.sockets.registration import prove_key
    from tether.server.store import Store

    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "s.db")
        key = key_for("alone")
        reg = Registration(name="alone", instance_id="i", proof=key.register_proof("c" * 32, "alone", "i"))
        assert prove_key(store, "alone", reg, "c" * 32) is None  # enrols
        times = []
        for _ in range(samples):
            start = time.perf_counter()
            prove_key(store, "alone", reg, "c" * 32)
            times.append(time.perf_counter() - start)
        store.close()
    return statistics.median(times) * 1e6


def measure(devices: int = 300, rounds: int = 7, concurrency: int = 25) -> list[dict[str, object]]:
    from tether.server.store import Store

    with tempfile.TemporaryDirectory() as tmp:
        servers: dict[str, tuple[subprocess.Popen[str], int]] = {}
        tokens: dict[str, dict[str, str]] = {}
        try:
            for mode in ("on", "off"):
                db = str(Path(tmp) / f"{mode}.db")
                store = Store(db)
                tokens[mode] = {f"dev{i:05d}": store.tokens.create("device", f"dev{i:05d}")[1] for i in range(devices)}
                store.close()
                proc = subprocess.Popen([sys.executable, "-m", "bench.registration_key", "--serve", mode, "--db", db],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        cwd=Path(__file__).resolve().parent.parent)
                assert proc.stdout is not None
                servers[mode] = (proc, int(proc.stdout.readline()))
            per: dict[str, list[float]] = {"on": [], "off": []}
            for mode in ("on", "off"):  # warm-up (not counted): imports, the keys' first-use enrolment
                asyncio.run(register_all(servers[mode][1], tokens[mode], mode == "on", concurrency))
            for r in range(rounds):
                for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    proc, port = servers[mode]
                    before = cpu_s(proc.pid)
                    asyncio.run(register_all(port, tokens[mode], mode == "on", concurrency))
                    per[mode].append((cpu_s(proc.pid) - before) / devices * 1e3)
        finally:
            for proc, _ in servers.values():
                if proc.stdin is not None:
                    proc.stdin.close()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    on, off = statistics.median(per["on"]), statistics.median(per["off"])
    diffs = [a - b for a, b in zip(per["on"], per["off"], strict=True)]
    alone = prove_key_alone()
    print(f"server CPU per registration, {rounds} interleaved rounds of {devices} (ms): "
          f"with the key proof {on:.3f} ({spread(per['on'])}), without {off:.3f} ({spread(per['off'])}); "
          f"round by round difference median {statistics.median(diffs):+.3f} ({spread(diffs)}); "
          f"prove_key alone {alone:.0f} us", flush=True)
    return [fleet_row("server CPU per registration, key proof", on, "ms", "without the proof", off,
                      f"<= +{GOAL_MS} ms", f"diff {statistics.median(diffs):+.3f} ms ({spread(diffs)})"),
            fleet_row("prove_key alone (read + Ed25519 verify)", alone / 1e3, "ms", "-", None, "-")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=25)
    parser.add_argument("--serve", choices=("on", "off"), help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.db)
        return
    rows = measure(args.devices, args.rounds, args.concurrency)
    extra = rows[0]["measured"] - rows[0]["anchor"]  # type: ignore[operator]
    print(f"goal {'met' if extra <= GOAL_MS else 'MISSED'}: {extra:+.3f} ms per registration (goal <= +{GOAL_MS})")


if __name__ == "__main__":
    main()
