"""Outcomes are facts across nodes (issue 28, docs/outcomes.md): a backplane (Redis) outage while a
command crosses nodes is reported as one — "outcome pending", the backplane named — never as "the
device left"; the device, which never moved, finishes the command once, and the outcome reaches the
asking node's audit and `GET /batches/{id}` once the backplane is back. With direct links between the nodes
(server/cluster/link.py) the answer crosses the link instead, and the caller gets its result at once."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from bench.kit.engines import Engine
from tests.cluster.test_faults import audit_rows, device_on, echo, gated, policy_args, until_file
from tests.kits.cluster import WAIT, ClusterKit


@pytest.mark.parametrize("links", ["off", "on"])
async def test_a_backplane_outage_mid_command_is_pending_then_recorded(tmp_path: Path, redis_engine: Engine,
                                                                       links: str) -> None:
    node_args = ["--set", "cluster_link=off"] if links == "off" else []
    async with ClusterKit(tmp_path, redis=redis_engine, node_args=node_args) as kit:
        a, b = await kit.start_node("a"), await kit.start_node("b")
        await device_on(kit, "laptop", b, [b, a], policy_args(kit))
        command, mark, gate = gated(kit, "x1")
        if links == "on":  # the link from a to b is open before the command goes (a dials on its first send)
            since = len(a.process.lines)
            assert (await kit.run(a, "laptop", echo(kit, "warm"))).status_code == 200
            await a.process.wait_line(r"cluster link to node b open", since)
        call = asyncio.create_task(kit.run(a, "laptop", [command], timeout=8))  # a forwards it to b
        await until_file(mark, "the command runs on laptop")
        assert a.redis_link is not None
        a.redis_link.cut()  # a cannot reach Redis; b and the device are fine
        fd = os.open(gate, os.O_RDWR)
        try:
            os.write(fd, b"go\n")  # the command ends well within its timeout; b's answer cannot reach a
            async with asyncio.timeout(WAIT + 20):
                response = await call
            assert response.status_code == 200, response.text
            [result] = response.json()["results"]
            if links == "on":  # b's answer came over the link: Redis was not needed
                assert result["status"] == "success", result
                assert mark.read_text() == "ran\n", "the command ran more than once"
                return
            assert result["status"] == "none" and result["error"].startswith("outcome pending:"), result
            assert "left node" not in result["error"], result["error"]
            assert "backplane" in result["error"], result["error"]
            batch_id = result["result"]["batch_id"]
            a.redis_link.restore()  # b's answer, waiting in a's inbox, is read and recorded
            record: dict[str, Any] = {}
            async with asyncio.timeout(WAIT):  # the record lives in another process: asked until it settles
                while record.get("state") != "done":
                    answer = await kit.http(a).get(f"/batches/{batch_id}")
                    assert answer.status_code == 200, answer.text
                    record = answer.json()
                    await asyncio.sleep(0.1)
        finally:
            os.close(fd)
        [done] = record["commands"]
        assert done["status"] == "success" and done["late"], record
        assert mark.read_text() == "ran\n", "the command ran more than once"


async def test_a_killed_asking_nodes_sent_row_is_settled_by_the_node_that_learned_the_outcome(
        tmp_path: Path, redis_engine: Engine) -> None:
    """kill -9 of the node a caller asked, while the command runs on a device another node holds: the
    row it wrote `sent` is settled by the holding node, which learned the outcome (issue 28, item 2)."""
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b = await kit.start_node("a"), await kit.start_node("b")
        await device_on(kit, "laptop", b, [b, a], policy_args(kit))
        command, mark, gate = gated(kit, "k1")
        call = asyncio.create_task(kit.run(a, "laptop", [command], timeout=WAIT))
        await until_file(mark, "the command runs on laptop")
        await kit.kill_node(a)
        call.cancel()  # its caller's connection died with a
        fd = os.open(gate, os.O_RDWR)
        try:
            os.write(fd, b"go\n")  # the command ends; b's answer goes to a node that is gone
            row: dict[str, Any] = {}
            async with asyncio.timeout(kit.heartbeat["timeout"] * 3 + WAIT):  # until b sees a gone, and settles
                while row.get("status") != "success":
                    rows = [r for r in await audit_rows(kit, b, "laptop") if r.get("tool_name") == "shell.run"]
                    row = rows[0] if rows else {}
                    await asyncio.sleep(0.2)
        finally:
            os.close(fd)
        assert row["error"].startswith("late:"), row
        assert mark.read_text() == "ran\n", "the command ran more than once"
