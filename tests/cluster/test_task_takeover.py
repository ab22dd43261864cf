"""Tasks on servers sharing one database (issue 16): each running task is leased by the server running it,
a server starting beside it leaves it alone, and when that server dies another takes the task over as a
restart does — the step that was running is asked about (retry / skip / cancel), never run twice.

Real `tether server` processes sharing one database (a SQLite file, or PostgreSQL in the PostgreSQL pass),
a real device, kill -9. No Redis: task leases live in the database beside the tasks.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.kits import db as dbkit
from tests.kits.cluster import WAIT, ClusterKit, Node


@pytest.fixture(params=["shared database", "cluster"])
async def kit(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[ClusterKit]:
    """Servers sharing one database, and the same as nodes of a cluster (`--cluster`, `--node-id`)."""
    redis = request.getfixturevalue("redis_engine") if request.param == "cluster" else None
    async with ClusterKit(tmp_path, redis=redis) as kit:
        yield kit


async def _events(kit: ClusterKit, node: Node, task_id: str) -> AsyncIterator[dict[str, Any]]:
    """The task's events as `node` streams them (past ones first)."""
    async for kind, data in kit.task_frames(node, task_id):
        if kind == "task_event":
            yield data


async def _until(stream: AsyncIterator[dict[str, Any]], kind: str) -> dict[str, Any]:
    async with asyncio.timeout(WAIT):
        async for event in stream:
            if event["kind"] == kind:
                return event
    raise AssertionError(f"the stream ended before a {kind} event")


def _sleeps_audited(kit: ClusterKit, task_id: str) -> int:
    """How many times the step's command was sent to a device, from the shared audit log (a task's commands
    are requested by `task:<first 12 characters of its id> for <token>`). Every row counts, failures too: the
    orphaned run's row is settled with the failure its device reported (the run was stopped)."""
    who = f"task:{task_id[:12]} %"
    if dbkit.backend() == "postgres":
        out = dbkit.psql(kit.db, f"SELECT count(*) FROM audit WHERE requested_by LIKE '{who}' "
                                 "AND tool_name = 'shell.run'")
        return int(out.strip())
    with sqlite3.connect(kit.db) as db:
        return db.execute("SELECT count(*) FROM audit WHERE requested_by LIKE ? AND tool_name = 'shell.run'",
                          (who,)).fetchone()[0]


async def _until_audited(kit: ClusterKit, task_id: str, count: int) -> None:
    """Until the step's command has its audit row: a row is written before the command goes, but the
    step_started event comes first (with PostgreSQL the row is committed by the audit worker just after)."""
    async with asyncio.timeout(WAIT):
        while _sleeps_audited(kit, task_id) < count:
            await asyncio.sleep(0.05)


async def test_a_killed_servers_task_is_taken_over_and_asked_about_never_rerun(kit: ClusterKit, tmp_path: Path) -> None:
    a = await kit.start_node("a")
    laptop = await kit.start_device("laptop", [a])
    await laptop.process.wait_line("registered as")
    work = tmp_path / "work"
    work.mkdir()
    created = await kit.http(a).post("/tasks", json={"request": "wait a minute", "device": "laptop", "plan": [
        {"skill": "shell.run", "args": {"cmd": "sleep", "argv": ["60"], "cwd": str(work)}}]})
    assert created.status_code == 201, created.text
    task_id = created.json()["id"]
    on_a = _events(kit, a, task_id)
    await _until(on_a, "step_started")
    await on_a.aclose()
    await _until_audited(kit, task_id, 1)  # the command went to the device (its start saved before it was sent)

    # a second server starting beside the live one leaves its running task alone
    b = await kit.start_node("b")
    seen_by_b = (await kit.http(b).get(f"/tasks/{task_id}")).json()
    assert seen_by_b["state"] == "running" and "server_restarted" not in [e["kind"] for e in seen_by_b["events"]]
    if kit.redis is None:  # b cannot steer a's task: said, nothing lost
        refused = await kit.http(b).post(f"/tasks/{task_id}/cancel")
        assert refused.status_code == 409 and "is run by server" in refused.json()["error"], refused.text
    else:  # a cluster node forwards it to a, which answers as itself (no question is open: refused there)
        refused = await kit.http(b).post(f"/tasks/{task_id}/answer", json={"answer": "yes"})
        assert refused.status_code == 409 and "is run by server" not in refused.json()["error"], refused.text
    assert (await kit.http(a).get(f"/tasks/{task_id}")).json()["state"] == "running"

    on_b = _events(kit, b, task_id)
    await kit.kill_node(a)
    restarted = await _until(on_b, "server_restarted")  # within the lease: heartbeat timeout + grace
    question = await _until(on_b, "question")
    assert restarted and "retry" in json.dumps(question["data"]).lower(), question
    await on_b.aclose()
    task = (await kit.http(b).get(f"/tasks/{task_id}")).json()
    assert task["state"] == "waiting_for_user", task["state"]
    assert _sleeps_audited(kit, task_id) == 1  # the step ran once, on a; b asked instead of running it again

    cancelled = await kit.http(b).post(f"/tasks/{task_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled", cancelled.text
    assert _sleeps_audited(kit, task_id) == 1


async def test_a_restarted_server_takes_its_own_tasks_back_at_once(kit: ClusterKit, tmp_path: Path) -> None:
    """The lease is the node's (host, state directory, database): its restart does not wait for it to expire."""
    a = await kit.start_node("a", extra=["--heartbeat-timeout", "60"])  # a lease far longer than the test's wait
    laptop = await kit.start_device("laptop", [a])
    await laptop.process.wait_line("registered as")
    created = await kit.http(a).post("/tasks", json={"request": "wait", "device": "laptop", "plan": [
        {"skill": "shell.run", "args": {"cmd": "sleep", "argv": ["60"], "cwd": str(tmp_path)}}]})
    task_id = created.json()["id"]
    on_a = _events(kit, a, task_id)
    await _until(on_a, "step_started")
    await on_a.aclose()
    await _until_audited(kit, task_id, 1)  # the command went to the device: killed now, its node must ask it
    await kit.kill_node(a)
    a = await kit.start_node("a", extra=["--heartbeat-timeout", "60"])
    on_a = _events(kit, a, task_id)  # the device is asked about the step first (it stopped the orphaned sleep)
    await _until(on_a, "question")
    await on_a.aclose()
    task = (await kit.http(a).get(f"/tasks/{task_id}")).json()
    assert task["state"] == "waiting_for_user" and task["events"][-1]["kind"] in ("question", "server_restarted")
    assert _sleeps_audited(kit, task_id) == 1
