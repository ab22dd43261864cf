"""A real `tether device` process's CPU per command, with nothing else of tether in the way (issue 33, item 1).

    python -m bench.device_cpu [--devices 2] [--trips 400] [--repeats 5] [--inflight 1]
                               [--tool list_tools|file_info] [--base SRC] [--py-spy SECONDS]

This process plays the server with the least a server can do: a bare `websockets` server that accepts each
device's REGISTER with a REGISTER_ACK, answers its heartbeats with the server's own heartbeat frame, and sends it
COMMAND frames as the hub writes them (one command per batch: `list_tools` of a namespace no tool has, or
`file_info` of `/tmp`), each sent once the previous result came back (`--inflight N`: N batches kept in flight
per device). The devices are `python -m tether.cli device` processes as a user starts them (log level info to a
log file, the `files` and `system` tool sets). With `--base SRC` (another checkout's `src`, e.g.
`git archive main src | tar -x -C /tmp/b`) every second device runs that tree: a before/after in one run.

Anchor, in the same run and interleaved round by round: a `websockets` client process that connects the same
way and echoes each COMMAND frame back (the transport's own cost; what a device would cost if tether's code
cost nothing). Per round and process: CPU seconds (user + system, all threads, /proc schedstat) over the round
divided by its commands; printed as medians over the rounds with their spread, and the load average.
`--in-process`: instead, the device's Python path alone, from the COMMAND text to the COMMAND_RESULTS text:
a child process builds the device as `tether device` does (its config, policy, hidden paths and log handler,
logging to a file at info) and feeds `--trips` COMMAND frames to its `DeviceSession` and `BatchRunner` as the
link's reader does, the results written to a sink instead of a socket; CPU per command of the whole child
(`time.process_time`), `--repeats` children per tree, interleaved (with `--base`, every second child runs it).

`--py-spy SECONDS`: afterwards, py-spy (when installed) samples the first device for SECONDS while trips run
(`--py-spy-raw FILE` keeps its raw samples). `--cprofile OUT`: the first device runs under cProfile timed by its
CPU clock (`bench.kit.cpu_profile`), which writes its figures to OUT when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import psutil
from websockets.exceptions import ConnectionClosed

from bench._stats import spread
from bench.kit.procs.cpu import cpu_exact_s, profile_device
from bench.kit.procs.devices import device_env
from bench.kit.procs.fleet import CHEAP, stop_process
from tether.protocol.codec import encode
from tether.protocol.messages import RegisterAck, ServerMessage, ServerMessageType
from tether.protocol.models import Command
from tether.protocol.wire import SERVER_HEARTBEAT

TOOLS = {"file_info": {"tool_name": "file_info", "parameters": {"path": "/tmp"}}, "list_tools": CHEAP}
START_S = 120.0


class Peer:
    """One connected device (or the echo anchor): its socket and the answers awaited by response_id."""

    def __init__(self, ws: object) -> None:
        self.ws = ws
        self.waiting: dict[str, asyncio.Future[str]] = {}


class FakeServer:
    """The least of an AIP server: register, answer heartbeats, send COMMANDs, hand back their results."""

    def __init__(self, tool: Mapping[str, object]) -> None:
        self.peers: dict[str, Peer] = {}
        self.joined = asyncio.Event()
        self.command = Command.model_validate(tool)
        self.seq = 0

    async def handle(self, ws: object) -> None:
        first = json.loads(await ws.recv())  # type: ignore[attr-defined]
        if first.get("type") == "register":
            name = first["payload"]["name"]
            ack = RegisterAck(device=name, heartbeat_interval=30.0, heartbeat_timeout=90.0, grace_period=60.0,
                              max_frame_bytes=8 * 1024 * 1024)
            await ws.send(encode(ServerMessage(type=ServerMessageType.REGISTER_ACK,  # type: ignore[attr-defined]
                                               payload=ack.model_dump())))
        else:  # the echo anchor says hello with its name
            name = first["hello"]
        peer = self.peers[name] = Peer(ws)
        self.joined.set()
        with contextlib.suppress(ConnectionClosed):
            await self.serve(ws, peer)

    async def serve(self, ws: object, peer: Peer) -> None:
        async for raw in ws:  # type: ignore[attr-defined]
            frame = raw if isinstance(raw, str) else raw.decode()
            if '"type":"heartbeat"' in frame:
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
                await ws.send(SERVER_HEARTBEAT % (stamp, os.urandom(16).hex()))  # type: ignore[attr-defined]
                continue
            key = json.loads(frame).get("prev_response_id") or json.loads(frame).get("response_id")
            waiter = peer.waiting.pop(key, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(frame)

    def frame(self) -> tuple[str, str]:
        self.seq += 1
        rid = f"{self.seq:032x}"
        command = self.command.model_copy(update={"call_id": f"c{self.seq:031x}"})
        return rid, encode(ServerMessage(type=ServerMessageType.COMMAND, response_id=rid, actions=[command],
                                         timeout=30, early_exit=True))

    async def trips(self, name: str, n: int, inflight: int) -> None:
        """`n` batches to `name`, `inflight` at a time; fails on any answer that is not a success."""
        peer = self.peers[name]
        frames = [self.frame() for _ in range(n)]  # built before the clock: the server's cost is not measured
        loop = asyncio.get_running_loop()

        async def lane(part: list[tuple[str, str]]) -> None:
            for rid, text in part:
                waiter = peer.waiting[rid] = loop.create_future()
                await peer.ws.send(text)  # type: ignore[attr-defined]
                answer = await asyncio.wait_for(waiter, 30)
                if '"status":"success"' not in answer and '"type":"command"' not in answer:
                    raise RuntimeError(f"{name}: {answer[:300]}")

        await asyncio.gather(*(lane(frames[i::inflight]) for i in range(inflight)))


@asynccontextmanager
async def devices(tmp: Path, url: str, names: list[str], base: Path | None,
                  cprofile: Path | None = None) -> AsyncIterator[list[psutil.Process]]:
    env, argv_root = device_env(tmp)
    procs: list[asyncio.subprocess.Process] = []
    try:
        for i, name in enumerate(names):
            (tmp / name).mkdir()
            (tmp / name / "token").write_text("bench-token")
            tree = {**env, "PYTHONPATH": str(base)} if base is not None and i % 2 else env
            profiled = ["-m", "bench.kit.cpu_profile", str(cprofile)] if cprofile is not None and i == 0 else []
            with (tmp / f"{name}.log").open("wb") as log:
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, *(profiled or ["-m"]), "tether.cli", "device", "--server", url, "--name", name,
                    "--token-file", str(tmp / name / "token"), "--state-dir", str(tmp / name), *argv_root,
                    stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=tree))
        yield [psutil.Process(p.pid) for p in procs]
    finally:
        for proc in procs:
            await stop_process(proc, grace=15)


async def echo_peer(url: str) -> None:
    """`--peer-echo URL`: the anchor's far end, until stdin closes."""
    from websockets.asyncio.client import connect

    loop = asyncio.get_running_loop()
    eof = loop.run_in_executor(None, sys.stdin.buffer.read)
    async with connect(url, compression=None, max_size=None, ping_interval=None) as ws:
        await ws.send(json.dumps({"hello": "echo"}))

        async def echo() -> None:
            async for message in ws:
                await ws.send(message)

        task = asyncio.create_task(echo())
        await eof
        task.cancel()


async def measure(args: argparse.Namespace) -> None:
    from websockets.asyncio.server import serve

    server = FakeServer(TOOLS[args.tool])
    names = [f"dev-{i:02d}" for i in range(args.devices)]
    async with contextlib.AsyncExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tether-devcpu-")))
        ws_server = await stack.enter_async_context(serve(server.handle, "127.0.0.1", 0, compression=None,
                                                          max_size=None, ping_interval=None))
        port = next(iter(ws_server.sockets)).getsockname()[1]
        url = f"ws://127.0.0.1:{port}/aip"
        procs = await stack.enter_async_context(devices(tmp, url, names, args.base, args.cprofile))
        echo = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.device_cpu", "--peer-echo", url,
                                                    stdin=asyncio.subprocess.PIPE)
        stack.push_async_callback(stop_process, echo, 10)
        deadline = time.monotonic() + START_S
        while not all(n in server.peers for n in [*names, "echo"]):
            for proc, name in zip(procs, names, strict=True):
                if proc.status() == psutil.STATUS_ZOMBIE:
                    raise RuntimeError(f"{name} exited: {(tmp / f'{name}.log').read_text()[-1500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {sorted(server.peers)} connected after {START_S:g} s")
            server.joined.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.joined.wait(), 1.0)
        echo_proc = psutil.Process(echo.pid)
        who = {**dict(zip(names, procs, strict=True)), "echo": echo_proc}
        for name in who:  # warm-up
            await server.trips(name, 200, args.inflight)
        cpu: dict[str, list[float]] = {name: [] for name in who}
        wall: dict[str, list[float]] = {name: [] for name in who}
        order = list(who.items())
        for round_no in range(args.repeats):
            shift = round_no % len(order)  # each round starts with another process: none always goes first
            for name, proc in order[shift:] + order[:shift]:
                c0, t0 = cpu_exact_s(proc), time.perf_counter()
                await server.trips(name, args.trips, args.inflight)
                wall[name].append((time.perf_counter() - t0) / args.trips)
                cpu[name].append((cpu_exact_s(proc) - c0) / args.trips)
        spied = ""
        if args.py_spy:
            raw = args.py_spy_raw or tmp / "spy.txt"
            sampling = asyncio.create_task(asyncio.to_thread(profile_device, procs[0].pid, args.py_spy, raw))
            while not sampling.done():
                await server.trips(names[0], 200, args.inflight)
            spied = sampling.result()
    load = os.getloadavg()[0]
    print(f"device CPU per command: {args.tool}, one command per batch, {args.inflight} in flight; {args.repeats} "
          f"interleaved rounds of {args.trips}; {os.cpu_count()} cores, load {load:.1f}")
    echo_us = statistics.median(cpu["echo"]) * 1e6
    print(f"{'anchor: websockets client echoing the COMMAND frame':<44} CPU {echo_us:7.1f} us per frame "
          f"({spread([c * 1e6 for c in cpu['echo']])}); wall {statistics.median(wall['echo']) * 1e6:.0f} us per trip")
    trees: dict[str, list[float]] = {"this tree": [], "--base tree": []}
    for i, name in enumerate(names):
        us = statistics.median(cpu[name]) * 1e6
        tree = "--base tree" if args.base is not None and i % 2 else "this tree"
        trees[tree].append(us)
        print(f"{name + ' (' + tree + ')':<44} CPU {us:7.1f} us per command ({spread([c * 1e6 for c in cpu[name]])}) "
              f"-> {us / echo_us:.2f}x the echo; wall {statistics.median(wall[name]) * 1e6:.0f} us per trip")
    for tree, values in trees.items():
        if values:
            print(f"  {tree}: median {statistics.median(values):.1f} us per command")
    if trees["--base tree"] and trees["this tree"]:
        ratio = statistics.median(trees["this tree"]) / statistics.median(trees["--base tree"])
        ours, base = names[0::2], names[1::2]
        per_round = [statistics.median(cpu[n][r] for n in ours) / statistics.median(cpu[n][r] for n in base)
                     for r in range(args.repeats)]
        print(f"  this tree / --base tree: {ratio:.3f} (of the medians); per round {statistics.median(per_round):.3f} "
              f"(median of {args.repeats}, {spread(per_round)})")
    if spied:
        print(f"\npy-spy of {names[0]} (own time, idle left out):\n{spied}")


async def in_process_child(trips: int, tool: str) -> None:
    """`--in-process-child TRIPS TOOL`: the device's path from COMMAND text to COMMAND_RESULTS text, `trips`
    times after a warm-up; prints the CPU microseconds per command."""
    with tempfile.TemporaryDirectory(prefix="tether-devcpu-in-") as tmp_name:
        await _in_process(Path(tmp_name), trips, tool)


async def _in_process(tmp: Path, trips: int, tool: str) -> None:
    import gc

    from tether.cli.views.logs import configure
    from tether.device.link.run_here import run_in_this_task
    from tether.device.serve import _build
    from tether.protocol.device_session import CommandsArrived, DeviceSession, DeviceSessionState

    (tmp / "device.yaml").write_text("device:\n  builtin: [files, system]\n")
    log = (tmp / "device.log").open("w", buffering=1)  # as a service's stderr: line-buffered, to a file
    sys.stderr = log
    configure("info", "plain")
    served = await _build("ws://127.0.0.1:9/aip", token="bench", config=str(tmp / "device.yaml"), name="dev",
                          state_dir=str(tmp / "state"))
    link = served.connection
    link.outbox.open(8 * 1024 * 1024)
    sent: list[int] = []
    failed: list[str] = []

    def write_now(text: str) -> bool:  # what the socket's send does first: the frame's bytes
        sent.append(len(text.encode()))
        if '"status":"success"' not in text and len(failed) < 3:
            failed.append(text[:300])
        return True

    link.outbox.write_now = write_now
    session = DeviceSession("dev", "bench")
    session.state = DeviceSessionState.OPEN
    server = FakeServer(TOOLS[tool])
    warm = 2000
    frames = [server.frame()[1] for _ in range(trips + warm)]
    batches = link.batches
    run = getattr(batches, "run_here", None)  # this tree's; an older one has the function alone

    async def feed(part: list[str]) -> None:
        for frame in part:
            event = session.receive_open(frame)
            assert type(event) is CommandsArrived, event
            coro = batches.submit(event.batch, run_here=True)
            if coro is not None:
                await (run(coro, lambda: None) if run is not None else run_in_this_task(coro, lambda: None))

    await feed(frames[:warm])
    gc.collect()
    gc.freeze()  # as `tether device` does at its first registration
    start = time.process_time()
    await feed(frames[warm:])
    took = time.process_time() - start
    await served.local.aclose()
    sys.stderr = sys.__stderr__
    log.close()
    if len(sent) != trips + warm or failed:
        raise SystemExit(f"{len(sent)} results for {trips + warm} commands; not a success: {failed}")
    print(f"{took / trips * 1e6:.2f}")


async def in_process(args: argparse.Namespace) -> None:
    trees = ["this tree", "--base tree"] if args.base is not None else ["this tree"]
    cpu: dict[str, list[float]] = {tree: [] for tree in trees}
    for _ in range(args.repeats):
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": str(args.base)} if tree == "--base tree" else dict(os.environ)
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.device_cpu", "--in-process-child", str(args.trips), args.tool,
                stdout=asyncio.subprocess.PIPE, env=env)
            out, _ = await child.communicate()
            if child.returncode != 0:
                raise SystemExit(f"the {tree}'s child failed ({child.returncode})")
            cpu[tree].append(float(out.decode().split()[-1]))
    load = os.getloadavg()[0]
    print(f"the device's Python path, in process: {args.tool}, one command per batch; {args.repeats} interleaved "
          f"children of {args.trips} commands; {os.cpu_count()} cores, load {load:.1f}")
    for tree, values in cpu.items():
        print(f"  {tree}: CPU {statistics.median(values):.1f} us per command ({spread(values)})")
    if args.base is not None:
        ratio = statistics.median(cpu["this tree"]) / statistics.median(cpu["--base tree"])
        print(f"  this tree / --base tree: {ratio:.3f}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--peer-echo":
        asyncio.run(echo_peer(sys.argv[2]))
        return
    if len(sys.argv) == 4 and sys.argv[1] == "--in-process-child":
        asyncio.run(in_process_child(int(sys.argv[2]), sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--trips", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inflight", type=int, default=1)
    parser.add_argument("--tool", choices=sorted(TOOLS), default="list_tools")
    parser.add_argument("--base", type=Path, metavar="SRC")
    parser.add_argument("--in-process", action="store_true", help="the device's Python path alone (see above)")
    parser.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--cprofile", type=Path, metavar="OUT", help="run the first device under cProfile timed by "
                        "its CPU clock (bench.kit.cpu_profile; slower than real): its figures go to OUT")
    parser.add_argument("--py-spy-raw", type=Path, metavar="FILE", help="keep py-spy's raw samples here")
    args = parser.parse_args()
    if args.devices < 1 or args.trips < 1 or args.repeats < 1 or args.inflight < 1:
        sys.exit("--devices, --trips, --repeats and --inflight must be at least 1")
    asyncio.run(in_process(args) if args.in_process else measure(args))


if __name__ == "__main__":
    main()
