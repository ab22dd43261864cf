"""An agent's answer sent to a node that does not run the task (red team of "an agent never approves", see
docs/security/approvals-red-team.md).

The node that receives `POST /tasks/{id}/answer` judges whether the answer approves something from its own
view of the task, the stored row; the node running the task then applies the answer to its live question.
While the stored row lags the live task (a save not yet written, or refused, as here by a trigger in the shared
database), the agent saw the approval question on the live task (`GET /tasks/{id}` on the node running it; its
event stream tells it only once saved) and answered it at the other node:
judged as "no question is open" there, applied as "approve" where the task runs.

Real `tether server` nodes sharing one SQLite/PostgreSQL database and a real redis-server, a real `tether
device` whose policy holds `touch` for a person.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from pathlib import Path

from bench.kit.engines import Engine
from tests.kits import db as dbkit
from tests.kits.cluster import WAIT, ClusterKit

# a task's row may not be saved while it waits for a person: the stored row lags the live task there
SQLITE_FREEZE = ("CREATE TRIGGER freeze_tasks BEFORE UPDATE ON tasks WHEN NEW.state = 'waiting_for_user' BEGIN "
                 "SELECT RAISE(ABORT, 'tasks frozen by the test'); END;")
PG_FREEZE = ("CREATE FUNCTION freeze_tasks() RETURNS trigger LANGUAGE plpgsql AS "
             "$$ BEGIN RAISE EXCEPTION 'tasks frozen by the test'; END $$; "
             "CREATE TRIGGER freeze_tasks BEFORE UPDATE ON tasks FOR EACH ROW WHEN (NEW.state = 'waiting_for_user') "
             "EXECUTE FUNCTION freeze_tasks();")


def _on_db(kit: ClusterKit, sqlite_sql: str, pg_sql: str) -> None:
    """A statement on the nodes' shared database, as another client of it would run it."""
    if kit.db.startswith("postgresql"):  # the kit's database as the nodes were given it: a URL or a file
        dbkit.psql(kit.db, pg_sql)
    else:
        with contextlib.closing(sqlite3.connect(kit.db, timeout=60)) as conn:
            conn.executescript(sqlite_sql)


async def test_an_agents_answer_judged_on_a_stale_node_never_approves(tmp_path: Path, redis_engine: Engine) -> None:
    work = tmp_path / "work"
    work.mkdir()
    victim = work / "planted"
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"commands": {"touch": {"approve": True}}, "read_roots": [str(tmp_path)],
                                  "write_roots": [str(tmp_path)]}))
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b = [await kit.start_node(name) for name in ("a", "b")]
        device = await kit.start_device("alpha", [a], extra=["--policy", str(policy)])
        await device.registered()
        _on_db(kit, SQLITE_FREEZE, PG_FREEZE)
        made = await kit.http(a).post("/tokens", json={"kind": "api", "name": "robot", "agent": True,
                                                       "scopes": ["read", "execute"]})
        assert made.status_code == 201, made.text
        robot = {"Authorization": f"Bearer {made.json()['token']}"}
        created = await kit.http(a).post("/tasks", headers=robot, json={"request": "plant a file", "device": "alpha",
                                         "plan": [{"skill": "shell.run", "args": {
                                             "cmd": "touch", "argv": [str(victim)], "cwd": str(work)}}]})
        assert created.status_code == 201, created.text
        task_id = created.json()["id"]
        question: dict[str, object] = {}
        async with asyncio.timeout(WAIT):  # the live task where it runs: its stream tells a question once saved
            while not question:
                shown = (await kit.http(a).get(f"/tasks/{task_id}")).json()
                if shown["state"] == "waiting_for_user" and shown["questions"]:
                    question = shown["questions"][-1]
                else:
                    await asyncio.sleep(0.05)
        assert question.get("kind") == "approval", question
        for body in ({"answer": "approve"}, {"answer": "approve", "question_id": question["id"]}):
            sent = await kit.http(b).post(f"/tasks/{task_id}/answer", json=body, headers=robot)
            assert sent.status_code in (403, 409), (body, sent.status_code, sent.text)
            assert "error" in sent.json(), sent.text
        live = (await kit.http(a).get(f"/tasks/{task_id}")).json()
        assert live["state"] == "waiting_for_user" and live["questions"][-1]["id"] == question["id"], live
        assert live["questions"][-1]["answer"] is None, live["questions"]
        assert not victim.exists()
        # a person approves what the node they ask shows: b shows no question yet, so nothing is approved there
        # (the open one is not what they were shown); a, which shows it, takes the approval
        person = {"Authorization": f"Bearer {await kit.token('api', 'alice', ['read', 'execute', 'approve'], via=a)}"}
        unseen = await kit.http(b).post(f"/tasks/{task_id}/approval", json={"approved": True}, headers=person)
        assert unseen.status_code == 409 and "nothing was approved" in unseen.json()["error"], unseen.text
        assert not victim.exists()
        approved = await kit.http(a).post(f"/tasks/{task_id}/approval", json={"approved": True}, headers=person)
        assert approved.status_code == 200, approved.text
        async with asyncio.timeout(WAIT):
            async for kind, _data in kit.task_frames(a, task_id):
                if kind == "end":
                    break
        assert victim.exists()  # the person's approval ran it: the refusals above were not the setup failing
        _on_db(kit, "DROP TRIGGER freeze_tasks;", "DROP TRIGGER freeze_tasks ON tasks; DROP FUNCTION freeze_tasks();")
