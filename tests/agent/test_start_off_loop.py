"""The task service's start-up with PostgreSQL runs its statements off the event loop (issue 28, item 4): the
task store opens, the unfinished tasks are read and their leases claimed on worker threads, so a locked `tasks`
table delays the start only — the loop (where the hub and a cluster node's heartbeats already run) keeps turning.

A real app (`create_agent_app`) on a private PostgreSQL database; another session holds `LOCK TABLE tasks`
while the app starts: a coroutine on the same loop sees the server's session waiting for that lock while the
start has not finished (a start waiting on the loop would hold this coroutine until its statement timed out).
Released, the start claims and holds the task a previous server left waiting for a person.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kits import db as dbkit
from tether.agent.run.task import Question, Task, TaskState
from tether.agent.server_app import create_agent_app
from tether.agent.tasks.store import TaskStore
from tether.server.settings import ServerSettings

WAIT = 30.0


@pytest.fixture
def pg_url() -> Iterator[str]:
    with dbkit.fresh_postgres_database("start") as url:
        yield url


def waiting_task(store: TaskStore) -> Task:
    """A task a stopped server left waiting for an approval: a restart keeps it waiting (no step runs)."""
    task = Task(request="tidy up", device="alpha")
    task.transition(TaskState.RUNNING)
    task.questions.append(Question(question="approve?", options=["approve", "deny"], kind="approval"))
    task.transition(TaskState.WAITING_FOR_USER)
    store.save(task)
    return task


def test_a_locked_tasks_table_delays_the_start_not_the_event_loop(pg_url: str, tmp_path: Path) -> None:
    import psycopg

    store = TaskStore(pg_url)
    task = waiting_task(store)
    store.close()
    app = create_agent_app(ServerSettings(db_path=tmp_path / "unused.db", db_url=pg_url, node_id="n1"))
    locker = psycopg.connect(pg_url)  # not autocommit: the lock is held until its rollback
    locker.execute("LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE")

    def lock_waiters() -> int:
        with psycopg.connect(pg_url, autocommit=True) as watcher:
            row = watcher.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                  "AND wait_event_type = 'Lock'").fetchone()
            return int(row[0]) if row else 0

    async def scenario() -> None:
        started, stop = asyncio.Event(), asyncio.Event()

        async def serve() -> None:
            async with app.router.lifespan_context(app):
                started.set()
                await stop.wait()

        job = asyncio.create_task(serve())
        try:
            async with asyncio.timeout(WAIT):  # this coroutine runs while the start waits for the lock
                while not await asyncio.to_thread(lock_waiters):
                    assert not job.done(), job.exception()
                    await asyncio.sleep(0.05)
            assert not started.is_set()
            await asyncio.to_thread(locker.rollback)
            await asyncio.wait_for(started.wait(), WAIT)
            service = app.state.tasks
            assert task.id in service._live and service._live[task.id].state is TaskState.WAITING_FOR_USER
            assert await service.store.table.call(service._leases.holder, task.id) == "n1"
        finally:
            stop.set()
            await asyncio.wait_for(job, WAIT)

    try:
        asyncio.run(scenario())
    finally:
        locker.close()
