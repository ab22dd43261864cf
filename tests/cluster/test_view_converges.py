"""The cluster's view converges (issue 28, item 5): real nodes, a real redis-server, real devices.

- a node stopped (SIGSTOP) past its lease, so the others drop it and show its devices offline, then
  resumed (SIGCONT): every node lists its devices online at it again within a beat of it listing them
  itself (the device, silent-server timeout passed, reconnects to the same node; nothing was broadcast
  while the node slept);
- Redis stopped and started again empty: every node's device list agrees again within a beat of it
  being back; a command routed meanwhile says the backplane is down, and a command that was crossing
  through the whole outage gets its result (its node is not called gone for rejoining after the asker).

Each wait polls the other processes' /devices (their state lives there) with an upper bound; the
convergence time is measured from the event it follows and bounded by the heartbeat it claims.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

from bench.kit.engines import Engine
from tests.cluster.test_faults import gated, policy_args, until_file
from tests.kits.cluster import HEARTBEAT, WAIT, ClusterKit, Device, Node

BEAT_S = HEARTBEAT["timeout"] / 3  # the nodes' heartbeat period (settings.lease_s / 3)
SLACK_S = 1.5  # a loaded 2-core machine: HTTP polls and process scheduling, on top of the beat


async def device_on(kit: ClusterKit, name: str, node: Node, extra: list[str]) -> Device:
    """A device given `node`'s URL only (it stays with that node); waits until it registered."""
    device = await kit.start_device(name, [node], extra=extra)
    await device.registered()
    return device


async def views(kit: ClusterKit, nodes: list[Node]) -> dict[str, dict[str, Any]]:
    """Each node's device list: node name -> {device: (status, node)}."""
    found: dict[str, dict[str, Any]] = {}
    for node in nodes:
        response = await kit.http(node).get("/devices")
        assert response.status_code == 200, response.text
        found[node.name] = {row["name"]: (row["status"] != "offline", row["node"]) for row in response.json()}
        # a node that has not rejoined yet still lists what it knew before: not a view that agrees
        found[node.name]["backplane"] = (await kit.health(node))["cluster"]["backplane"]
    return found


async def until_views(kit: ClusterKit, nodes: list[Node], want: dict[str, Any], what: str) -> float:
    """Poll every node's /devices until each lists `want` ({device: (online, node)}) with its backplane
    ok; the monotonic time it first did. Bounded by WAIT."""
    want = {**want, "backplane": "ok"}
    last: dict[str, dict[str, Any]] = {}
    try:
        async with asyncio.timeout(WAIT):
            while True:
                last = await views(kit, nodes)
                if all(all(view.get(d) == state for d, state in want.items()) for view in last.values()):
                    return time.monotonic()
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"{what}: the views never agreed on {want}; last: {last}") from None


async def test_a_node_stalled_past_its_lease_is_listed_again_within_a_beat(tmp_path: Path,
                                                                           redis_engine: Engine) -> None:
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b, c = [await kit.start_node(name) for name in ("a", "b", "c")]
        await device_on(kit, "desk", a, [])
        laptop = await device_on(kit, "laptop", b, [])  # b's URL only: it stays with b
        everyone = {"desk": (True, "a"), "laptop": (True, "b")}
        await until_views(kit, [a, b, c], everyone, "before the stall")

        mark = len(laptop.process.lines)
        os.kill(b.process.pid, signal.SIGSTOP)
        try:
            await until_views(kit, [a, c], {"laptop": (False, None), "desk": (True, "a")},
                              "b's lease ran out: a and c show its device offline")
            # the stall outlasts the device's heartbeat timeout (the lease is as long): it drops the link
            await laptop.process.wait_line(r"connection to \S+ lost", mark)
        finally:
            os.kill(b.process.pid, signal.SIGCONT)
        await laptop.registered(since=mark)  # back on b: a command now finds it there, not in a grace period
        seen_by_b = await until_views(kit, [b], everyone, "b lists its own device")
        agreed = await until_views(kit, [a, b, c], everyone, "every node lists b's device again")
        assert agreed - seen_by_b <= BEAT_S + SLACK_S, f"converged {agreed - seen_by_b:.2f} s after b listed it"
        answer = await kit.run(c, "laptop", [{"tool_name": "shell.run", "parameters": {
            "cmd": "echo", "argv": ["again"], "cwd": str(kit.tmp)}}])
        assert answer.status_code == 200 and answer.json()["results"][0]["status"] == "success", answer.text


async def test_views_agree_within_a_beat_after_redis_returns_and_an_outage_is_named(
        tmp_path: Path, redis_engine: Engine) -> None:
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b = await kit.start_node("a"), await kit.start_node("b")
        await device_on(kit, "desk", a, policy_args(kit))
        await device_on(kit, "laptop", b, policy_args(kit))
        everyone = {"desk": (True, "a"), "laptop": (True, "b")}
        await until_views(kit, [a, b], everyone, "before the outage")
        crossing, crossing_mark, gate = gated(kit, "crossing")
        call = asyncio.create_task(kit.run(a, "laptop", [crossing], timeout=30))  # a forwards it to b
        await until_file(crossing_mark, "the crossing command runs on laptop")

        await asyncio.to_thread(redis_engine.stop)
        # a learns of the outage at its next beat (or Redis call), not as Redis stops: until then a command for
        # laptop goes over a's open link to b as usual (and here would wait in line behind the crossing one)
        async with asyncio.timeout(WAIT):
            while (await kit.health(a))["cluster"]["backplane"] == "ok":
                await asyncio.sleep(0.05)
        counted = kit.tmp / "live" / "meanwhile.ran"
        meanwhile = await kit.run(a, "laptop", [{"tool_name": "shell.run", "parameters": {
            "cmd": "sh", "argv": ["-c", f"echo ran >> {counted}"], "cwd": str(kit.tmp)}}], timeout=5)
        body = meanwhile.json()
        error = body.get("error") or body["results"][0]["error"]
        assert "backplane" in error and "left" not in error, body

        await asyncio.to_thread(redis_engine.restart)  # empty: no key, no stream survived
        back = time.monotonic()
        agreed = await until_views(kit, [a, b], everyone, "after Redis returned")
        # the nodes try the backplane again every REJOIN_S (0.5 s), then each checks the others' sets at its beat
        assert agreed - back <= 0.5 + BEAT_S + SLACK_S, f"converged {agreed - back:.2f} s after Redis returned"
        # the crossing command, still running on b through all this, ends: its device never moved, so a
        # (which rejoined before or after b) still waits on b for it rather than calling it gone
        fd = os.open(gate, os.O_RDWR)
        try:
            os.write(fd, b"go\n")
            async with asyncio.timeout(WAIT + 40):
                response = await call
        finally:
            os.close(fd)
        [result] = response.json()["results"]
        assert result["status"] == "success", result
        lines = counted.read_text().splitlines() if counted.exists() else []
        assert len(lines) <= 1, "the command routed during the outage ran twice"
        assert crossing_mark.read_text() == "ran\n", "the crossing command ran more than once"
        again = await kit.run(a, "laptop", [{"tool_name": "shell.run", "parameters": {
            "cmd": "echo", "argv": ["again"], "cwd": str(kit.tmp)}}])
        assert again.status_code == 200 and again.json()["results"][0]["status"] == "success", again.text
