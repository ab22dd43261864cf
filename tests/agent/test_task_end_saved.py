"""A task's end is told only once it is saved: its final save failing (the store refuses the write) holds the end
back from its followers, webhooks and the other nodes, shows the task as the store holds it, and degrades
`/health`; the end is told when the retried save succeeds, and a server stopped first leaves a state its restart
settles without running a step twice. So are its other events (a question is told once saved), and an answer is
acknowledged only once saved: a person told "taken" (200) is never asked the same question again.

The fault is the store's own: a trigger in the server's database (SQLite or PostgreSQL, TETHER_TEST_DB) refuses
to write a task's row in an ended state, as a full disk refuses the write that ends it. Nothing in the server is
replaced."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.kits import db as dbkit
from tests.kits.task import WAIT, AgentServer
from tether.tools.policy.model import Policy, default_policy

ENDED = "('done', 'failed', 'cancelled')"
REFUSAL = "database or disk is full (the fault this test puts at the store)"
SQLITE_REFUSE = (f"CREATE TRIGGER refuse_end BEFORE UPDATE ON tasks WHEN NEW.state IN {ENDED} "
                 f"BEGIN SELECT RAISE(ABORT, '{REFUSAL}'); END;")
PG_REFUSE = ("CREATE FUNCTION refuse_end() RETURNS trigger LANGUAGE plpgsql AS "
             f"$$ BEGIN RAISE EXCEPTION '{REFUSAL}'; END $$; "
             "CREATE TRIGGER refuse_end BEFORE UPDATE ON tasks FOR EACH ROW "
             f"WHEN (NEW.state IN {ENDED}) EXECUTE FUNCTION refuse_end();")
SQLITE_ALLOW = "DROP TRIGGER refuse_end;"
PG_ALLOW = "DROP TRIGGER refuse_end ON tasks; DROP FUNCTION refuse_end();"


def _sql(db: Path, sqlite_sql: str, pg_sql: str) -> str:
    """Run a statement on the server's database as another client would; the first column of the first row."""
    target = dbkit.server_db(db)
    if isinstance(target, Path):
        with contextlib.closing(sqlite3.connect(target, timeout=WAIT)) as conn:
            if sqlite_sql.lstrip().upper().startswith("SELECT"):
                row = conn.execute(sqlite_sql).fetchone()
                return str(row[0]) if row else ""
            conn.executescript(sqlite_sql)
            return ""
    return dbkit.psql(str(target), pg_sql).strip()


async def on_db(db: Path, sqlite_sql: str, pg_sql: str | None = None) -> str:
    return await asyncio.to_thread(_sql, db, sqlite_sql, pg_sql or sqlite_sql)


async def stored_state(db: Path, task_id: str) -> str:
    return await on_db(db, f"SELECT state FROM tasks WHERE id = '{task_id}'")


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Wait for `check` to hold, looking again every 20 ms, at most WAIT seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not await check():
        assert loop.time() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.fixture
def alpha(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Policy, Path]:
    other_temp = tmp_path / "device-temp"
    other_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(other_temp))
    root = tmp_path / "alpha"
    root.mkdir()
    return default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]}), root


async def _ended_but_unsaved(server: AgentServer, db: Path, root: Path
                             ) -> tuple[str, asyncio.Task[list[dict[str, Any]]]]:
    """A one-step task on alpha whose end the store refuses, followed from its start; once `/health` says a
    task could not be saved, what every reader sees is checked. The task's id and its follower."""
    await on_db(db, SQLITE_REFUSE, PG_REFUSE)
    created = await server.create(request="write a", device="alpha",
                                  plan=[{"skill": "write_file", "args": {"file_path": str(root / "a.txt"),
                                                                         "content": "a"}}])
    tid = created["id"]
    # two followers: one over the task's event stream, as a remote watcher; one in process, whose queue nobody
    # drains, so what the service told its followers is all in it when looked at
    follower = asyncio.create_task(server.events_until(tid, lambda e: False))
    _, past, queue = server.tasks.subscribe(tid)

    async def refused() -> bool:  # the save of the task's end failed: it is kept in memory to be retried
        return tid in server.tasks._saver.unsaved and server.tasks._saver.problem is not None

    await until(refused, "the end's save to fail")
    # the store holds the task running; every reader is shown that, and why its end is not told
    assert await stored_state(db, tid) == "running"
    # its followers were told nothing of the end: no `done` event, no end of their stream
    assert queue is not None, "the follower was told the task had ended"
    told = [*past]
    while not queue.empty():
        told.append(queue.get_nowait())
    assert None not in told, "the follower's stream was ended"
    assert not any(e.kind == "state" and e.data["to"] == "done" for e in told if e is not None), told
    assert not follower.done()
    task = (await server.api.get(f"/tasks/{tid}")).json()
    assert task["state"] == "running", task["state"]
    assert task["ending"]["state"] == "done" and "disk is full" in task["ending"]["unsaved"], task["ending"]
    assert not any(e["kind"] == "state" and e["data"]["to"] == "done" for e in task["events"])
    [row] = [r for r in (await server.api.get("/tasks")).json() if r["id"] == tid]
    assert row["state"] == "running" and row["ending"]["state"] == "done", row
    assert (root / "a.txt").read_text() == "a"  # the step ran
    health = (await server.api.get("/health")).json()  # the store's fault is reported
    assert health["status"] == "degraded" and "not saved" in health["database"], health
    assert "disk is full" in health["database"], health
    return tid, follower


async def test_the_end_is_told_once_the_retried_save_succeeds(tmp_path: Path, alpha: tuple[Policy, Path]) -> None:
    policy, root = alpha
    db = tmp_path / "server.db"
    async with AgentServer(tmp_path, db_path=db) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        tid, follower = await _ended_but_unsaved(server, db, root)
        refused_cancel = await server.api.post(f"/tasks/{tid}/cancel")
        assert refused_cancel.status_code == 503 and "disk is full" in refused_cancel.json()["error"]
        await on_db(db, SQLITE_ALLOW, PG_ALLOW)  # space again: the save is retried, then the end is told
        events = await asyncio.wait_for(follower, WAIT)
        assert await stored_state(db, tid) == "done"
        assert (await server.api.get("/health")).json()["status"] == "ok"
        task = (await server.api.get(f"/tasks/{tid}")).json()
    assert [e["data"]["to"] for e in events if e["kind"] == "state"][-1] == "done"
    assert events[-1]["kind"] == "end" and events[-1]["data"]["state"] == "done" and events[-1]["data"]["ended"]
    assert task["state"] == "done" and task.get("ending") is None


async def test_a_server_stopped_before_the_end_is_saved_never_told_it(tmp_path: Path,
                                                                      alpha: tuple[Policy, Path]) -> None:
    policy, root = alpha
    db = tmp_path / "server.db"
    async with AgentServer(tmp_path, db_path=db) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        tid, follower = await _ended_but_unsaved(server, db, root)
        for hook in server.app.state.on_stopping:  # what `tether server` runs as its shutdown begins
            hook()
        # stopping with the end unsaved: the follower's stream ends as a task still going, as the store holds it
        events = await asyncio.wait_for(follower, WAIT)
    assert not any(e["kind"] == "state" and e["data"]["to"] == "done" for e in events)
    assert events[-1]["kind"] == "end" and events[-1]["data"]["state"] == "running", events[-1]
    assert events[-1]["data"]["ended"] is False
    assert await stored_state(db, tid) == "running"
    await on_db(db, SQLITE_ALLOW, PG_ALLOW)
    async with AgentServer(tmp_path, db_path=db) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha-2")
        # settled as any unfinished task: its step in flight as the store holds it is asked about on the device (a
        # new process, with no record of it), then put to the person; never reported done, never run again
        await server.events_until(tid, lambda e: e["kind"] == "question" and e["data"]["kind"] == "restart")
        waiting = (await server.api.get(f"/tasks/{tid}")).json()
        writes = [r for r in server.store.audit.rows(limit=50)
                  if r["tool_name"] == "write_file" and tid[:12] in (r["requested_by"] or "")]
        assert (await server.api.post(f"/tasks/{tid}/answer", json={"answer": "skip"})).status_code == 200
        task = await server.finished(tid)
    assert waiting["state"] == "waiting_for_user" and waiting.get("ending") is None
    assert len(writes) == 1, writes  # its step ran once
    assert task["state"] == "done", task["error"]
    assert await stored_state(db, tid) == "done"


WAIT_REFUSAL = "database or disk is full (the fault this test puts at the store, on a waiting task)"
# the row that puts the task to wait for a person (its question), and then any row of a task the store holds waiting
SQLITE_REFUSE_WAIT = (f"CREATE TRIGGER refuse_wait BEFORE UPDATE ON tasks WHEN NEW.state = 'waiting_for_user' "
                      f"BEGIN SELECT RAISE(ABORT, '{WAIT_REFUSAL}'); END;")
PG_REFUSE_WAIT = ("CREATE FUNCTION refuse_wait() RETURNS trigger LANGUAGE plpgsql AS "
                  f"$$ BEGIN RAISE EXCEPTION '{WAIT_REFUSAL}'; END $$; "
                  "CREATE TRIGGER refuse_wait BEFORE UPDATE ON tasks FOR EACH ROW "
                  "WHEN (NEW.state = 'waiting_for_user') EXECUTE FUNCTION refuse_wait();")
SQLITE_REFUSE_ANSWER = SQLITE_REFUSE_WAIT.replace("NEW.state", "OLD.state")
PG_REFUSE_ANSWER = PG_REFUSE_WAIT.replace("NEW.state", "OLD.state")
SQLITE_ALLOW_WAIT = "DROP TRIGGER refuse_wait;"
PG_ALLOW_WAIT = "DROP TRIGGER refuse_wait ON tasks; DROP FUNCTION refuse_wait();"


def _told(past: list[Any], queue: asyncio.Queue[Any] | None) -> list[Any]:
    """What an in-process follower has been told so far: its past events and what its queue holds."""
    told = [*past]
    while queue is not None and not queue.empty():
        told.append(queue.get_nowait())
    return [e for e in told if e is not None]


async def test_a_question_and_its_answer_are_told_only_once_saved(tmp_path: Path, alpha: tuple[Policy, Path]) -> None:
    policy, root = alpha
    db = tmp_path / "server.db"
    target = root / "a.txt"
    async with AgentServer(tmp_path, db_path=db) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        await on_db(db, SQLITE_REFUSE_WAIT, PG_REFUSE_WAIT)  # the row with the plan's question cannot be written
        created = await server.create(request="write a", device="alpha", confirm="always",
                                      plan=[{"skill": "write_file", "args": {"file_path": str(target),
                                                                             "content": "a"}}])
        tid = created["id"]
        _, past, queue = server.tasks.subscribe(tid)

        async def refused() -> bool:
            return tid in server.tasks._saver.unsaved and server.tasks._saver.problem is not None

        await until(refused, "the question's save to fail")
        told = _told(past, queue)
        assert not any(e.kind in ("question", "plan") for e in told), told  # nobody is asked what is not saved
        shown = (await server.api.get(f"/tasks/{tid}")).json()
        assert not any(e["kind"] == "question" for e in shown["events"]), shown["events"]
        assert not any(i["task"] == tid for i in (await server.api.get("/approvals")).json())  # nor in the inbox
        await on_db(db, SQLITE_ALLOW_WAIT, PG_ALLOW_WAIT)  # the retried save succeeds: now it is told
        [*_, asked] = await server.events_until(tid, lambda e: e["kind"] == "question")
        assert await stored_state(db, tid) == "waiting_for_user"
        assert any(i["task"] == tid for i in (await server.api.get("/approvals")).json())

        await on_db(db, SQLITE_REFUSE_ANSWER, PG_REFUSE_ANSWER)  # the answer's row cannot be written
        answered = await server.api.post(f"/tasks/{tid}/answer", json={"answer": "run",
                                                                       "question_id": asked["data"]["id"]})
        # not a 200: the person is told their answer is not saved (a restart would ask again)
        assert answered.status_code == 503, answered.text
        assert "could not be saved" in answered.json()["error"] and "disk is full" in answered.json()["error"]
        assert not any(e.kind == "user_answer" for e in _told([], queue))
        for hook in server.app.state.on_stopping:  # stopped before the answer is saved
            hook()
    assert await stored_state(db, tid) == "waiting_for_user"
    assert not target.exists()  # nothing ran on an answer the store does not hold
    await on_db(db, SQLITE_ALLOW_WAIT, PG_ALLOW_WAIT)
    async with AgentServer(tmp_path, db_path=db) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha-2")
        # the question is open again, as the person was told (503): answered now, it is saved and never asked again
        waiting = (await server.api.get(f"/tasks/{tid}")).json()
        assert waiting["state"] == "waiting_for_user", waiting["state"]
        assert waiting["questions"][-1]["id"] == asked["data"]["id"] and waiting["questions"][-1]["answer"] is None
        answered = await server.api.post(f"/tasks/{tid}/answer", json={"answer": "run"})
        assert answered.status_code == 200, answered.text
        assert await stored_state(db, tid) != "waiting_for_user"  # saved before the 200
        task = await server.finished(tid)
    assert task["state"] == "done", task["error"]
    assert target.read_text() == "a"


STALL_S = 3  # how long the database holds the answer's row (PostgreSQL: a trigger sleeping in the write)
PG_STALL_ANSWER = ("CREATE FUNCTION stall_answer() RETURNS trigger LANGUAGE plpgsql AS "
                   f"$$ BEGIN PERFORM pg_sleep({STALL_S}); RETURN NEW; END $$; "
                   "CREATE TRIGGER stall_answer BEFORE UPDATE ON tasks FOR EACH ROW "
                   "WHEN (OLD.state = 'waiting_for_user') EXECUTE FUNCTION stall_answer();")


async def test_an_answer_whose_save_stalls_is_answered_503_and_saved_later_never_asked_again(
        tmp_path: Path, alpha: tuple[Policy, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled database (a lock, a slow disk) holds the answer's write: the reply does not wait for it past
    `REPLY_SAVE_WAIT_S` but says 503 — taken, not saved yet — and the write lands later: the question is not
    asked again and the step runs once. With SQLite the write is made on the event loop, so its reply comes once
    it is written: 200."""
    from tether.agent.tasks.service import answering

    monkeypatch.setattr(answering, "REPLY_SAVE_WAIT_S", 0.5)
    policy, root = alpha
    db = tmp_path / "server.db"
    target = root / "a.txt"
    postgres = not isinstance(dbkit.server_db(db), Path)
    async with AgentServer(tmp_path, db_path=db) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        created = await server.create(request="write a", device="alpha", confirm="always",
                                      plan=[{"skill": "write_file", "args": {"file_path": str(target),
                                                                             "content": "a"}}])
        tid = created["id"]
        [*_, asked] = await server.events_until(tid, lambda e: e["kind"] == "question")
        if postgres:
            await on_db(db, "SELECT 1", PG_STALL_ANSWER)
        answered = await server.api.post(f"/tasks/{tid}/answer", json={"answer": "run",
                                                                       "question_id": asked["data"]["id"]})
        if postgres:
            assert answered.status_code == 503, answered.text
            assert "was not saved within 0.5s" in answered.json()["error"], answered.text
        else:
            assert answered.status_code == 200, answered.text
            assert await stored_state(db, tid) != "waiting_for_user"

        async def saved() -> bool:
            return await stored_state(db, tid) != "waiting_for_user"

        await until(saved, "the stalled answer's row to be written")
        task = await server.finished(tid)
    assert task["state"] == "done", task["error"]
    assert target.read_text() == "a"
    assert [e["kind"] for e in task["events"]].count("question") == 1  # asked once, answered once
    if postgres:
        await on_db(db, "SELECT 1", "DROP TRIGGER stall_answer ON tasks; DROP FUNCTION stall_answer();")


async def test_a_cancel_whose_save_stalls_is_answered_503_and_saved_later(
        tmp_path: Path, alpha: tuple[Policy, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for a cancel: past `REPLY_SAVE_WAIT_S` of a stalled write the reply is 503 (stopped here, not saved
    yet); the write lands later and the task is stored cancelled. SQLite: 200 once written."""
    from tether.agent.tasks.service import answering

    monkeypatch.setattr(answering, "REPLY_SAVE_WAIT_S", 0.5)
    policy, root = alpha
    db = tmp_path / "server.db"
    postgres = not isinstance(dbkit.server_db(db), Path)
    async with AgentServer(tmp_path, db_path=db) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        created = await server.create(request="write a", device="alpha", confirm="always",
                                      plan=[{"skill": "write_file", "args": {"file_path": str(root / "a.txt"),
                                                                             "content": "a"}}])
        tid = created["id"]
        await server.events_until(tid, lambda e: e["kind"] == "question")
        if postgres:
            await on_db(db, "SELECT 1", PG_STALL_ANSWER)
        cancelled = await server.api.post(f"/tasks/{tid}/cancel")
        if postgres:
            assert cancelled.status_code == 503, cancelled.text
            assert "not written within 0.5s" in cancelled.json()["error"], cancelled.text
        else:
            assert cancelled.status_code == 200, cancelled.text

        async def saved() -> bool:
            return await stored_state(db, tid) == "cancelled"

        await until(saved, "the stalled cancel's row to be written")
        task = await server.finished(tid)
    assert task["state"] == "cancelled" and not (root / "a.txt").exists()
    if postgres:
        await on_db(db, "SELECT 1", "DROP TRIGGER stall_answer ON tasks; DROP FUNCTION stall_answer();")
