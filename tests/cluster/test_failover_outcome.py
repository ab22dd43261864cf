"""Fail-over asks the device first, in a cluster (issue 28, item 2): node a runs a task whose step runs on a
device held by node b; a is killed (-9) mid-step; the step finishes on the device; b takes the task over, asks
the device for the step's outcome, records it and goes on without asking a person. Real nodes on one database
and Redis, a real device; runs counted from a file; the audit read back."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.kits import db as dbkit
from tests.kits.chaos import Runs
from tests.kits.cluster import WAIT, ClusterKit
from tether.server.store.engine import Engine


@pytest.fixture
async def kit(tmp_path: Path, redis_engine: Engine) -> AsyncIterator[ClusterKit]:
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        yield kit


@pytest.fixture
def runs(tmp_path: Path) -> Any:
    r = Runs(tmp_path / "counted")
    yield r
    r.close()


def audit_row(kit: ClusterKit, call_id: str) -> tuple[str, str | None]:
    if dbkit.backend() == "postgres":
        out = dbkit.psql(kit.db, f"SELECT status || '|' || coalesce(error, '') FROM audit WHERE call_id = '{call_id}'")
        status, _, error = out.strip().partition("|")
        return status, error or None
    with sqlite3.connect(kit.db) as db:
        status, error = db.execute("SELECT status, error FROM audit WHERE call_id = ?", (call_id,)).fetchone()
    return status, error


async def test_the_node_taking_over_takes_the_finished_step_from_the_device(kit: ClusterKit, runs: Runs) -> None:
    a = await kit.start_node("a")
    b = await kit.start_node("b")
    laptop = await kit.start_device("laptop", [b], extra=["--policy", str(runs.policy)])
    await laptop.process.wait_line("registered as")
    plan = [runs.step("t1"), runs.step("t2", gated=True), runs.step("t3")]
    created = await kit.http(a).post("/tasks", json={"request": "three counted steps", "device": "laptop",
                                                     "plan": plan})
    assert created.status_code == 201, created.text
    task_id = created.json()["id"]
    await asyncio.to_thread(runs.wait_started, "t2")
    task = (await kit.http(a).get(f"/tasks/{task_id}")).json()
    [call_t2] = {e["data"]["call_id"] for e in task["events"] if e["kind"] == "step_started" and e["data"]["step"] == 1}

    await kit.kill_node(a)
    assert runs.open_gate("t2")  # the step ends on the device; the node that sent it is gone

    async with asyncio.timeout(WAIT):  # b takes the task over when a's lease runs out
        while (task := (await kit.http(b).get(f"/tasks/{task_id}")).json())["state"] == "running":
            await asyncio.sleep(0.2)
    assert task["state"] == "done", (task["state"], task.get("questions"), task.get("error"))
    assert not [q for q in task.get("questions", []) if q["kind"] == "restart"], task["questions"]
    assert runs.counts() == {"t1": 1, "t2": 1, "t3": 1}
    [t2] = [s for s in task["steps"] if s["index"] == 1]
    assert t2["command"]["call_id"] == call_t2 and t2["result"]["result"]["stdout"] == "out:t2\n"
    assert any(e["kind"] == "step_finished" and e["data"].get("from_device") for e in task["events"])
    status, error = audit_row(kit, call_t2)
    assert status == "success", (status, error)  # a's `sent` row, settled by the node that learned the outcome


async def test_a_step_still_running_is_waited_for_then_taken_from_the_device(kit: ClusterKit, runs: Runs) -> None:
    a = await kit.start_node("a")
    b = await kit.start_node("b")
    laptop = await kit.start_device("laptop", [b], extra=["--policy", str(runs.policy)])
    await laptop.process.wait_line("registered as")
    plan = [runs.step("w1", gated=True), runs.step("w2")]
    created = await kit.http(a).post("/tasks", json={"request": "two counted steps", "device": "laptop",
                                                     "plan": plan})
    assert created.status_code == 201, created.text
    task_id = created.json()["id"]
    await asyncio.to_thread(runs.wait_started, "w1")
    await kit.kill_node(a)

    async with asyncio.timeout(WAIT):  # b takes the task over and finds the step still running on the device
        while not any(e["kind"] == "waiting_for_step"
                      for e in (await kit.http(b).get(f"/tasks/{task_id}")).json()["events"]):
            await asyncio.sleep(0.2)
    assert runs.open_gate("w1")
    async with asyncio.timeout(WAIT):
        while (task := (await kit.http(b).get(f"/tasks/{task_id}")).json())["state"] == "running":
            await asyncio.sleep(0.2)
    assert task["state"] == "done", (task["state"], task.get("questions"), task.get("error"))
    assert not task.get("questions")
    assert runs.counts() == {"w1": 1, "w2": 1}
    [w1] = [s for s in task["steps"] if s["index"] == 0]
    assert w1["result"]["status"] == "success" and w1["result"]["result"]["stdout"] == "out:w1\n"
    status, error = audit_row(kit, w1["command"]["call_id"])
    assert status == "success", (status, error)
