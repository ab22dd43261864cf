"""The cluster under faults (issue 16): real nodes (`tether server --cluster`), a real redis-server, real devices.

- kill -9 of the node holding a device while a command another node forwarded to it runs: the caller
  gets the result (the batch follows the device to its new node with the same ids, and the device
  answers from the run it had started), the command ran once, and the audit row of the node the caller
  asked ends with that outcome;
- the killed node's devices (given every node's URL) register on the other nodes within the heartbeat
  timeout + grace period, and take commands from any node there;
- Redis restarted while commands cross nodes: every call is answered (a result or a clear error), and
  commands cross again once Redis is back;
- a node partitioned from Redis refuses new work with a clear 503 and says so in /health, and takes
  work again once the partition heals.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.kit.engines import Engine
from tests.kits.cluster import WAIT, ClusterKit, Device, Node
from tests.kits.netutil import workspace_roots


def gated(kit: ClusterKit, label: str) -> tuple[dict[str, Any], Path, Path]:
    """A command that marks its start in a file and then waits on a FIFO the test holds: (command, mark,
    gate). The mark is appended to, so a second run of the same command shows as a second line."""
    live = kit.tmp / "live"
    live.mkdir(exist_ok=True)
    mark, gate = live / f"{label}.ran", live / f"{label}.gate"
    os.mkfifo(gate)
    script = live / "work.py"
    script.write_text("import pathlib, sys\n"
                      "live = pathlib.Path(sys.argv[1])\n"
                      "(live / (sys.argv[2] + '.ran')).open('a').write('ran\\n')\n"
                      "(live / (sys.argv[2] + '.gate')).open().readline()\n"
                      "print('done', sys.argv[2])\n")
    command = {"tool_name": "shell.run", "parameters": {"cmd": "python3", "argv": [str(script), str(live), label],
                                                        "cwd": str(kit.tmp)}}
    return command, mark, gate


def policy_args(kit: ClusterKit) -> list[str]:
    """The devices may write the marks while commands run (a live write root)."""
    live = kit.tmp / "live"
    live.mkdir(exist_ok=True)
    policy = kit.tmp / "policy.yaml"
    policy.write_text(workspace_roots(kit.tmp) + f"live_write_roots: [{str(live)!r}]\n")
    return ["--policy", str(policy)]


def echo(kit: ClusterKit, text: str) -> list[dict[str, Any]]:
    return [{"tool_name": "shell.run", "parameters": {"cmd": "echo", "argv": [text], "cwd": str(kit.tmp)}}]


async def until_file(path: Path, what: str) -> None:
    """A file another process creates (no event crosses to us): checked each loop turn, bounded."""
    async with asyncio.timeout(WAIT):
        while not path.exists():
            await asyncio.sleep(0.02)


async def until_health(kit: ClusterKit, node: Node, check: Any, what: str) -> dict[str, Any]:
    """Probe /health until `check(health)` holds (the state lives in another process), bounded by WAIT."""
    last: Any = None
    try:
        async with asyncio.timeout(WAIT):
            while True:
                response = await kit.http(node).get("/health")
                last = response.json()
                if check(last):
                    return last
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"{what}: /health of {node.name} never said so; last: {last}") from None


async def three_nodes(kit: ClusterKit) -> list[Node]:
    return [await kit.start_node(name) for name in ("a", "b", "c")]


async def device_on(kit: ClusterKit, name: str, first: Node, nodes: list[Node], extra: list[str]) -> Device:
    """A device given `first`'s URL first and the other nodes' after it; waits until it registered on `first`."""
    order = [first, *[n for n in nodes if n is not first]]
    device = await kit.start_device(name, order, extra=extra)
    assert await device.registered() is first
    return device


async def audit_rows(kit: ClusterKit, node: Node, device: str) -> list[dict[str, Any]]:
    response = await kit.http(node).get("/audit", params={"limit": 100, "device": device})
    assert response.status_code == 200, response.text
    return response.json()["rows"]


# ------------------------------------------------------------------ kill -9 of a node


@pytest.mark.parametrize("how", ["kill -9", "clean stop"])
async def test_the_holding_node_going_away_mid_command_gives_the_caller_the_result(
        tmp_path: Path, redis_engine: Engine, how: str) -> None:
    """kill -9, or a clean stop (SIGTERM: a rolling restart): the device keeps running the command, moves
    on, and the node the caller asked sends the batch again to its new node."""
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b, c = await three_nodes(kit)
        laptop = await device_on(kit, "laptop", a, [a, b, c], policy_args(kit))
        command, mark, gate = gated(kit, "k1")
        call = asyncio.create_task(kit.run(b, "laptop", [command], timeout=60))  # b forwards it to a
        await until_file(mark, "the command runs on laptop")
        since = len(laptop.process.lines)
        if how == "kill -9":
            await kit.kill_node(a)
        else:
            assert await kit.stop_node(a) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
        moved_to = await laptop.registered(since)
        assert moved_to in (b, c)
        fd = os.open(gate, os.O_RDWR)  # let the command end, now that its node is gone
        os.write(fd, b"go\n")
        async with asyncio.timeout(kit.heartbeat["timeout"] + kit.heartbeat["grace"] + WAIT):
            response = await call  # never silence
        os.close(fd)
        assert response.status_code == 200, response.text
        [result] = response.json()["results"]
        # b sent the batch again, with the same ids, to the node the device moved to: the device answered
        # from the run it had started under a (its record of calls), so the caller has the real result
        assert result["status"] == "success" and "done k1" in result["result"]["stdout"], result
        assert mark.read_text() == "ran\n", "the command ran more than once"
        rows = [r for r in await audit_rows(kit, b, "laptop") if r.get("tool_name") == "shell.run"]
        assert len(rows) == 1, rows  # audited once, by the node the caller asked, with its outcome
        assert rows[0].get("status") not in (None, "", "sent"), rows[0]
        # and the device takes commands on its new node, from any node
        for node in (b, c):
            answer = await kit.run(node, "laptop", echo(kit, "after"))
            assert answer.status_code == 200 and answer.json()["results"][0]["status"] == "success", answer.text


async def test_a_killed_nodes_devices_are_back_on_the_others_within_heartbeat_timeout_and_grace(
        tmp_path: Path, redis_engine: Engine) -> None:
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b, c = await three_nodes(kit)
        devices = [await device_on(kit, f"d{i}", a, [a, b, c], []) for i in range(3)]
        other = await device_on(kit, "steady", b, [a, b, c], [])
        marks = [len(d.process.lines) for d in devices]
        loop = asyncio.get_running_loop()
        killed = loop.time()
        await kit.kill_node(a)
        budget = kit.heartbeat["timeout"] + kit.heartbeat["grace"]
        landed = await asyncio.gather(*(d.registered(m, timeout=budget) for d, m in zip(devices, marks, strict=True)))
        took = loop.time() - killed
        assert all(node in (b, c) for node in landed), landed
        assert took <= budget, f"{took:.1f} s, more than the heartbeat timeout + grace ({budget:g} s)"
        for device in [*devices, other]:  # each one from the node that does not hold it, and from the one that does
            for node in (b, c):
                answer = await kit.run(node, device.name, echo(kit, device.name))
                assert answer.status_code == 200, answer.text
                assert answer.json()["results"][0]["status"] == "success", answer.text


# ------------------------------------------------------------------ Redis faults


async def test_redis_restarted_while_commands_cross_nodes(tmp_path: Path, redis_engine: Engine) -> None:
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b = await kit.start_node("a"), await kit.start_node("b")
        await device_on(kit, "laptop", a, [a, b], [])
        answers: list[tuple[int, dict[str, Any]]] = []
        stop = asyncio.Event()

        async def load(node: Node) -> None:
            while not stop.is_set():
                try:
                    response = await kit.run(node, "laptop", echo(kit, "x"), timeout=10)
                except httpx.HTTPError as exc:  # a dropped connection would be silence: the test fails on it
                    raise AssertionError(f"{node.name} dropped a call: {exc}") from None
                answers.append((response.status_code, response.json()))

        callers = [asyncio.create_task(load(node)) for node in (a, b, b)]
        async with asyncio.timeout(WAIT):
            while len(answers) < 10:  # under load first
                await asyncio.sleep(0.02)
        await asyncio.to_thread(redis_engine.restart)
        before = len(answers)
        async with asyncio.timeout(WAIT):  # work crosses again once Redis is back
            while not any(code == 200 and body["results"][0]["status"] == "success"
                          for code, body in answers[before:]):
                await asyncio.sleep(0.02)
        stop.set()
        await asyncio.gather(*callers)
        for code, body in answers:  # every call was answered: a result, or a clear refusal
            if code == 200:
                [result] = body["results"]
                assert result["status"] == "success" or result["error"], body
            else:
                assert code == 503 and body["error"], (code, body)


async def test_a_node_partitioned_from_redis_refuses_new_work_clearly_and_resumes(
        tmp_path: Path, redis_engine: Engine) -> None:
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b = await kit.start_node("a"), await kit.start_node("b")
        await device_on(kit, "laptop", b, [b, a], [])
        assert (await kit.run(a, "laptop", echo(kit, "before"))).status_code == 200
        assert a.redis_link is not None
        a.redis_link.cut()
        await until_health(kit, a, lambda h: h.get("status") != "ok", "a lost its backplane")
        refused = await kit.run(a, "laptop", echo(kit, "during"))
        assert refused.status_code == 503, refused.text
        assert "backplane" in refused.json()["error"]
        selected = await kit.http(a).post("/commands", json={"commands": echo(kit, "during"),
                                                             "requires": {"name": "laptop"}})
        assert selected.status_code == 503 and "backplane" in selected.json()["error"], selected.text
        task = await kit.http(a).post("/tasks", json={"request": "echo", "device": "laptop", "plan": [
            {"skill": "shell.run", "args": echo(kit, "during")[0]["parameters"]}]})
        assert task.status_code == 503 and "backplane" in task.json()["error"], task.text
        # b is not partitioned: it keeps working for its own device
        answer = await kit.run(b, "laptop", echo(kit, "during"))
        assert answer.status_code == 200 and answer.json()["results"][0]["status"] == "success", answer.text
        a.redis_link.restore()
        await until_health(kit, a, lambda h: h.get("status") == "ok", "a has its backplane back")
        again = await kit.run(a, "laptop", echo(kit, "after"))
        assert again.status_code == 200 and again.json()["results"][0]["status"] == "success", again.text
