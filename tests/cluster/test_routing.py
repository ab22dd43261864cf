"""Commands across the nodes of a cluster (issue 16): `tether server --cluster redis://… --node-id NAME`.

Real nodes (`tether server` processes) sharing one database and one real redis-server, real devices.
A device connected to node a takes commands sent to node b or c: they run on the device once, their
output and events come back through the node that was asked, and that node writes the one audit row.
Node b lists the device with the node holding it; /api/v1/health names the nodes and the backplane.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx

from bench.kit.engines import Engine
from tests.kits.cluster import CLI, WAIT, ClusterKit, Device, Node
from tests.kits.netutil import workspace_roots


def echo(kit: ClusterKit, text: str) -> list[dict[str, Any]]:
    return [{"tool_name": "shell.run", "parameters": {"cmd": "echo", "argv": [text], "cwd": str(kit.tmp)}}]


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    [result] = response.json()["results"]
    assert result["status"] == "success", result
    return result["result"]


async def device_on(kit: ClusterKit, name: str, first: Node, nodes: list[Node], extra: list[str] = ()) -> Device:
    """A device given `first`'s URL first (and the others after it), registered on `first`."""
    device = await kit.start_device(name, [first, *[n for n in nodes if n is not first]], extra=list(extra))
    assert await device.registered() is first
    return device


async def until_listed(kit: ClusterKit, node: Node, device: str, where: str) -> dict[str, Any]:
    """`node`'s row for `device` once it says `where` holds it (the broadcast crosses from another
    process: probed, bounded)."""
    last: Any = None
    async with asyncio.timeout(WAIT):
        while True:
            response = await kit.http(node).get(f"/devices/{device}")
            last = response.json()
            if response.status_code == 200 and last.get("node") == where and last["status"] != "offline":
                return last
            await asyncio.sleep(0.05)


async def until_health(kit: ClusterKit, node: Node, check: Any) -> dict[str, Any]:
    """`node`'s /health once `check` holds (what it reports comes from other processes: probed, bounded)."""
    last: Any = None
    try:
        async with asyncio.timeout(WAIT):
            while not check(last := await kit.health(node)):
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"/health of {node.name} never got there; last: {last}") from None
    return last


async def audit(kit: ClusterKit, node: Node, device: str) -> list[dict[str, Any]]:
    response = await kit.http(node).get("/audit", params={"limit": 200, "device": device})
    assert response.status_code == 200, response.text
    return response.json()["rows"]


async def test_a_command_sent_to_any_node_runs_on_the_device_another_node_holds(
        tmp_path: Path, redis_engine: Engine) -> None:
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b, c = [await kit.start_node(name) for name in ("a", "b", "c")]
        await device_on(kit, "laptop", a, [a, b, c])
        for node in (b, c, a):  # from the two nodes that do not hold it, and from the one that does
            out = ok(await kit.run(node, "laptop", echo(kit, f"via-{node.name}")))
            assert f"via-{node.name}" in json.dumps(out)
        rows = [r for r in await audit(kit, b, "laptop") if r.get("tool_name") == "shell.run"]
        assert len(rows) == 3, rows  # one row per command, written by the node that was asked
        assert {r["status"] for r in rows} == {"success"}, rows
        assert sorted(r["requested_by"] for r in rows) == ["api:cluster-kit"] * 3
        # b and c list it online, held by a; a lists it as its own
        assert (await until_listed(kit, b, "laptop", "a"))["status"] in ("online", "busy")
        await until_listed(kit, c, "laptop", "a")
        assert (await kit.http(a).get("/devices/laptop")).json()["node"] == "a"
        table = await asyncio.to_thread(subprocess.run, [*CLI, "devices", "--server", b.url], capture_output=True,
                                        text=True, timeout=WAIT, env={**kit.env, "TETHER_TOKEN": kit.admin_token})
        assert table.returncode == 0, table.stderr
        row = next(line for line in table.stdout.splitlines() if "laptop" in line)
        assert [cell.strip() for cell in row.split("│")][1:5] == ["laptop", "linux", "online", "a"], table.stdout
        health = await until_health(kit, b, lambda h: h["cluster"]["nodes"] == ["a", "b", "c"])
        assert health["status"] == "ok", health
        assert health["node"] == "b" and health["cluster"]["backplane"] == "ok"
        assert health["devices_here"] == 0 and (await kit.health(a))["devices_here"] == 1


async def test_events_stream_back_and_the_tools_list_crosses_nodes(tmp_path: Path, redis_engine: Engine) -> None:
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b = await kit.start_node("a"), await kit.start_node("b")
        await device_on(kit, "laptop", a, [a, b])
        talk = kit.tmp / "talk.py"
        talk.write_text("print('one', flush=True)\nprint('two', flush=True)\n")
        command = [{"tool_name": "shell.run", "parameters": {"cmd": "python3", "argv": [str(talk)],
                                                             "cwd": str(kit.tmp)}}]
        body = {"commands": command, "timeout": 30}
        kinds: list[str] = []
        outputs: list[str] = []
        async with kit.http(b).stream("POST", "/devices/laptop/commands", json=body,
                                      headers={"Accept": "text/event-stream"}) as response:
            assert response.status_code == 200
            kind = None
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                    kinds.append(kind)
                elif line.startswith("data: ") and kind == "event":
                    outputs.append(line)
        assert kinds[-1] == "results", kinds
        assert "event" in kinds, kinds  # the device's output events came through node b
        assert any("one" in line for line in outputs), outputs
        tools = await kit.http(b).get("/devices/laptop/tools")
        assert tools.status_code == 200, tools.text
        assert "shell.run" in {t["name"] for t in tools.json()} | {f"{t['namespace']}.{t['name']}"
                                                                   for t in tools.json()}


async def test_unknown_devices_and_a_batch_cancelled_from_a_third_node(tmp_path: Path, redis_engine: Engine) -> None:
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b, c = [await kit.start_node(name) for name in ("a", "b", "c")]
        await device_on(kit, "laptop", a, [a, b, c])
        missing = await kit.run(b, "nobody", echo(kit, "x"))
        assert missing.status_code == 404 and "nobody" in missing.json()["error"], missing.text
        gate = kit.tmp / "gate"
        os.mkfifo(gate)
        hold = kit.tmp / "hold.py"
        hold.write_text(f"print('started', flush=True)\nopen({str(gate)!r}).readline()\n")
        wait = [{"tool_name": "shell.run", "parameters": {"cmd": "python3", "argv": [str(hold)],
                                                          "cwd": str(kit.tmp)}}]
        body = {"commands": wait, "timeout": 60}
        async with kit.http(b).stream("POST", "/devices/laptop/commands", json=body,
                                      headers={"Accept": "text/event-stream"}) as response:
            batch = response.headers["X-Tether-Batch"]
            lines = response.aiter_lines()
            seen = []
            async for line in lines:  # the command runs on the device (its first output came back)
                seen.append(line)
                if '"stream"' in line and "started" in line:
                    break
            # c neither started it (b did) nor holds the device (a does): it asks the other nodes
            cancel = await kit.http(c).delete(f"/batches/{batch}")
            assert cancel.status_code == 200, (cancel.text, seen)
            rest = [line async for line in lines]
        results = json.loads(rest[rest.index("event: results") + 1].removeprefix("data: "))
        [result] = results["results"]
        assert result["status"] != "success" and "cancelled" in result["error"], result
        again = await kit.run(b, "laptop", echo(kit, "after"))
        assert "after" in json.dumps(ok(again))


async def _task_stream(kit: ClusterKit, node: Node, task_id: str, into: list[tuple[str, dict[str, Any]]]) -> None:
    """Every frame of `node`'s event stream of the task, until its `end` frame."""
    async for frame in kit.task_frames(node, task_id):
        into.append(frame)
        if frame[0] == "end":
            return


async def test_a_task_on_one_node_runs_steps_on_a_device_another_node_holds_and_a_third_follows_it(
        tmp_path: Path, redis_engine: Engine) -> None:
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b, c = [await kit.start_node(name) for name in ("a", "b", "c")]
        live = kit.tmp / "live"  # a live root: the step's process opens the test's FIFO itself, not a copy
        live.mkdir()
        policy = kit.tmp / "policy.yaml"
        policy.write_text(workspace_roots(kit.tmp) + f"live_write_roots: [{str(live)!r}]\n")
        await device_on(kit, "laptop", a, [a, b, c], ["--policy", str(policy)])
        gate = live / "task-gate"
        os.mkfifo(gate)
        hold = kit.tmp / "hold.py"
        hold.write_text(f"print('waiting', flush=True)\nopen({str(gate)!r}).readline()\nprint('released')\n")
        await until_listed(kit, b, "laptop", "a")
        created = await kit.http(b).post("/tasks", json={"request": "two steps", "device": "laptop", "plan": [
            {"skill": "shell.run", "args": {"cmd": "python3", "argv": [str(hold)], "cwd": str(kit.tmp)}},
            {"skill": "shell.run", "args": {"cmd": "echo", "argv": ["second"], "cwd": str(kit.tmp)}}]})
        assert created.status_code == 201, created.text
        task_id = created.json()["id"]
        seen_on_c: list[tuple[str, dict[str, Any]]] = []
        follower = asyncio.create_task(_task_stream(kit, c, task_id, seen_on_c))  # c neither runs it nor holds
        async with asyncio.timeout(WAIT):  # the first step runs on the device (a), started by b
            while not any(kind == "task_event" and data["kind"] == "step_started" for kind, data in seen_on_c):
                await asyncio.sleep(0.05)
        fd = os.open(gate, os.O_RDWR)  # never blocks this loop (it carries the nodes' Redis links)
        try:
            os.write(fd, b"go\n")
            async with asyncio.timeout(WAIT):
                await follower
        finally:
            os.close(fd)
        kinds = [data["kind"] for kind, data in seen_on_c if kind == "task_event"]
        assert kinds.count("step_finished") == 2, kinds  # c saw both steps end, live
        seqs = [data["seq"] for kind, data in seen_on_c if kind == "task_event"]
        assert seqs == sorted(set(seqs)), seqs  # each once, in order (stored ones, then relayed ones)
        end = seen_on_c[-1][1]
        assert end["state"] == "done" and end["ended"] is True, end
        task = (await kit.http(c).get(f"/tasks/{task_id}")).json()
        assert task["state"] == "done", task
        outputs = json.dumps(task["steps"])
        assert "released" in outputs and "second" in outputs, outputs


async def test_a_task_is_approved_and_cancelled_through_any_node(tmp_path: Path, redis_engine: Engine) -> None:
    """Node b runs the tasks (their leases); c forwards an approval and a cancel to b instead of refusing."""
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b, c = [await kit.start_node(name) for name in ("a", "b", "c")]
        await device_on(kit, "laptop", a, [a, b, c])
        await until_listed(kit, b, "laptop", "a")
        plan = [{"skill": "shell.run", "args": {"cmd": "echo", "argv": ["approved"], "cwd": str(kit.tmp)}}]
        first = await kit.http(b).post("/tasks", json={"request": "echo", "device": "laptop", "plan": plan,
                                                       "confirm": "always"})
        second = await kit.http(b).post("/tasks", json={"request": "echo", "device": "laptop", "plan": plan,
                                                        "confirm": "always"})
        assert first.status_code == 201 and second.status_code == 201, (first.text, second.text)
        first_id, second_id = first.json()["id"], second.json()["id"]
        for task_id in (first_id, second_id):
            async with asyncio.timeout(WAIT):  # b saved the question (the plan waits for a person)
                while (await kit.http(c).get(f"/tasks/{task_id}")).json()["state"] != "waiting_for_user":
                    await asyncio.sleep(0.05)
        frames: list[tuple[str, dict[str, Any]]] = []
        follower = asyncio.create_task(_task_stream(kit, c, first_id, frames))
        approved = await kit.http(c).post(f"/tasks/{first_id}/approval", json={"approved": True})
        assert approved.status_code == 200, approved.text  # b took it: no "is run by server" 409
        async with asyncio.timeout(WAIT):
            await follower
        assert frames[-1][1]["state"] == "done", frames[-1]
        task = (await kit.http(c).get(f"/tasks/{first_id}")).json()
        assert "approved" in json.dumps(task["steps"]), task
        cancelled = await kit.http(c).post(f"/tasks/{second_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled", cancelled.text
        assert (await kit.http(b).get(f"/tasks/{second_id}")).json()["state"] == "cancelled"
        again = await kit.http(c).post(f"/tasks/{second_id}/cancel")  # the owner's own answer, passed back
        assert again.status_code in (200, 409), again.text


async def test_an_mcp_client_of_any_node_sees_and_calls_every_nodes_devices(tmp_path: Path,
                                                                           redis_engine: Engine) -> None:
    import httpx2
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b = await kit.start_node("a"), await kit.start_node("b")
        await device_on(kit, "laptop", a, [a, b])
        await until_listed(kit, b, "laptop", "a")
        headers = {"Authorization": f"Bearer {kit.admin_token}"}
        async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(WAIT, read=WAIT)) as http, \
                streamable_http_client(f"{b.url}/mcp", http_client=http) as (read, write), \
                ClientSession(read, write, read_timeout_seconds=WAIT) as client:
            await client.initialize()
            names = {tool.name for tool in (await client.list_tools()).tools}
            assert "laptop__shell.run" in names, sorted(names)[:20]
            reply = await client.call_tool("laptop__shell.run", {"cmd": "echo", "argv": ["through-b"],
                                                                 "cwd": str(kit.tmp)})
            assert not reply.is_error, reply.content
            assert "through-b" in json.dumps([c.model_dump(mode="json") for c in reply.content]), reply.content
        rows = [r for r in await audit(kit, a, "laptop") if r.get("tool_name") == "shell.run"]
        assert len(rows) == 1 and rows[0]["status"] == "success", rows  # audited once, by b, seen from a


async def test_a_devices_policy_is_read_and_changed_through_another_node(tmp_path: Path, redis_engine: Engine) -> None:
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b = await kit.start_node("a"), await kit.start_node("b")
        await device_on(kit, "laptop", a, [a, b])
        await until_listed(kit, b, "laptop", "a")
        before = await kit.http(b).get("/devices/laptop/policy")
        assert before.status_code == 200 and before.json()["remote_allowed"], before.text  # the default
        changed = await kit.http(b).post("/devices/laptop/policy/allow", json={"program": "sh"})
        assert changed.status_code == 200, changed.text
        assert changed.json()["version"] == before.json()["version"] + 1
        seen_on_a = (await kit.http(a).get("/devices/laptop/policy")).json()
        assert seen_on_a["version"] == changed.json()["version"], seen_on_a
        rows = [r for r in await audit(kit, a, "laptop") if r.get("tool_name") == "policy.set"]
        assert len(rows) == 1 and rows[0]["status"] == "success", rows  # audited once, by b
