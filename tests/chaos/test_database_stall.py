"""The database off the event loop (issue 28, "Outcomes are facts", item 4).

Found on the landed code: `LOCK TABLE audit` for 10 s froze the whole node (/health timed out, command p99
10.7 s), and while PostgreSQL was down /health said `ok` with `audit_writable: true`.

Real processes on a private PostgreSQL (tests/kits/db.py): a `tether server` and a real device. Another
connection takes `LOCK TABLE audit IN ACCESS EXCLUSIVE MODE` and holds it until the checks are made: /health
answers within 100 ms (each request measured; a rare request delayed by the machine's load, never two in a
row, is allowed), the device stays online past the heartbeat timeout, a read of the audit log (GET /audit)
waits for the lock without holding anything else up, a command started under the lock waits for it
(it has not run: its `sent` row comes first) and, once the lock is released, runs once and is audited as
it ended. Then every backend of the server is terminated
(pg_terminate_backend): /health says `degraded` with a reason, and `ok` again once it reconnected.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.kits import db as dbkit
from tests.kits.chaos import WAIT, ChaosCluster, Ledger, Runs, check_invariants
from tests.kits.netutil import wait_for

HEALTH_BUDGET_S = 0.1
HEARTBEAT_TIMEOUT_S = 2.0  # SERVER_TIMING's --heartbeat-timeout: a device silent this long is marked offline
REQUEST_GAP_S = 0.05  # between /health requests under the lock: a monitor's pace, not a flood
MAY_BE_LATE = 0.05  # the share of requests a loaded machine may delay past the budget (never two in a row)
LOCKED_FOR_S = 10.0  # the lock of the report: 10 s, five heartbeat timeouts


@pytest.fixture
def pg_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ChaosCluster]:
    """A ChaosCluster whose server keeps its state in PostgreSQL: the session's (TETHER_TEST_DB=postgres)
    or a private one started here."""
    import psycopg  # noqa: F401  (the test extra installs it: a missing driver fails, never skips)

    with contextlib.ExitStack() as stack:
        if dbkit.backend() != "postgres":
            try:
                admin = stack.enter_context(dbkit.postgres_session())
            except (RuntimeError, FileNotFoundError) as exc:
                pytest.fail(f"no PostgreSQL to run against (scripts/test installs it): {exc}", pytrace=False)
            monkeypatch.setenv(dbkit.MODE_ENV, "postgres")
            stack.enter_context(dbkit.per_test_databases(admin))
        cluster = ChaosCluster(tmp_path)
        stack.callback(cluster.close)
        yield cluster


def timed_health(client: httpx.Client) -> tuple[float, dict[str, Any]]:
    start = time.monotonic()
    response = client.get("/health", timeout=WAIT)
    elapsed = time.monotonic() - start
    response.raise_for_status()
    return elapsed, response.json()


def waiting_on_audit_lock(locker: Any) -> int:
    """How many sessions wait for a lock on the audit table (the server's group commit, once it came)."""
    row = locker.execute("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'audit'::regclass"
                         ).fetchone()
    return int(row[0])


def test_a_locked_audit_table_delays_only_the_command_that_needs_it(
        pg_cluster: ChaosCluster, runs: Runs, ledger: Ledger, callers: ThreadPoolExecutor) -> None:
    import psycopg

    cluster = pg_cluster
    url = str(dbkit.server_db(cluster.db))
    cluster.device("alpha", runs)
    assert cluster.run("alpha", [runs.command("before")], ["before"], ledger) is not None

    with cluster.http() as client, psycopg.connect(url, autocommit=True) as watcher:
        assert timed_health(client)[1]["database"] == "ok"
        locker = psycopg.connect(url)  # a transaction of its own: the lock lasts until its rollback
        try:
            locker.execute("LOCK TABLE audit IN ACCESS EXCLUSIVE MODE")
            call = callers.submit(cluster.run, "alpha", [runs.command("during")], ["during"], ledger)
            # the command's group commit is on the database, waiting for the lock
            wait_for(lambda: waiting_on_audit_lock(watcher) > 0, "the server's audit write waiting on the lock",
                     WAIT)
            # a read of the audit table waits for the lock too: only that request, on the worker
            read = callers.submit(cluster.audit)
            locked_at = time.monotonic()
            times: list[float] = []
            while time.monotonic() - locked_at < LOCKED_FOR_S:
                elapsed, body = timed_health(client)
                times.append(elapsed)
                assert body["devices_online"] == 1, body
                time.sleep(REQUEST_GAP_S)  # a monitor's pace, not a wait for anything
            slow = [(round(t, 3), i) for i, t in enumerate(times) if t > HEALTH_BUDGET_S]
            # a loop blocked by the lock would make every request under it slow (seconds); a loaded machine
            # (this suite shares two cores) delays a rare request by ~0.2 s with or without the lock
            assert len(times) > 20 and len(slow) <= len(times) * MAY_BE_LATE, \
                f"/health over {HEALTH_BUDGET_S * 1000:g} ms under the lock: {slow} of {len(times)}"
            assert not any(b - a == 1 for (_, a), (_, b) in itertools.pairwise(slow)), \
                f"/health late twice in a row under the lock: {slow}"
            assert max(times) < HEALTH_BUDGET_S * 5, f"/health took {max(times):.3f}s under the lock"
            # heartbeats went on: past the heartbeat timeout the device is still online
            assert cluster.status("alpha") in ("online", "busy")
            assert not call.done(), "a command was answered while its audit row could not be written"
            assert not read.done(), "the audit was read through an exclusive lock"
            assert runs.counts()["during"] == 0, "the command ran before its `sent` row was written"
            # /health says what is known: the database does not answer (the probe waits behind the write)
            body = timed_health(client)[1]
            assert body["status"] == "degraded" and body["database"].startswith("degraded: "), body
        finally:
            locker.rollback()
            locker.close()

        results = call.result(timeout=WAIT)
        assert any(r["call_id"] == "call-before" for r in read.result(timeout=WAIT))
        assert results is not None and [r.status.value for r in results] == ["success"], results
        assert runs.counts()["during"] == 1
        [row] = [r for r in cluster.audit() if r["call_id"] == "call-during"]
        assert row["status"] == "success", row
        wait_for(lambda: timed_health(client)[1]["database"] == "ok", "/health ok after the lock", WAIT)

        # every backend of the server's database terminated: degraded with the reason, then ok again
        watcher.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        seen: list[dict[str, Any]] = []

        def degraded() -> bool:
            elapsed, body = timed_health(client)
            assert elapsed <= HEALTH_BUDGET_S * 5, elapsed
            seen.append(body)
            return body["status"] == "degraded"

        wait_for(degraded, "/health degraded after the database's backends were terminated", WAIT)
        body = seen[-1]
        assert body["audit_writable"] is False and body["database"].startswith("degraded: "), body
        assert len(body["database"]) > len("degraded: "), body
        wait_for(lambda: timed_health(client)[1]["status"] == "ok", "/health ok once reconnected", WAIT)

    assert cluster.run("alpha", [runs.command("after")], ["after"], ledger) is not None
    check_invariants(cluster, runs, ledger)
    assert runs.counts() == {"before": 1, "during": 1, "after": 1}, runs.counts()
    assert os.environ.get(dbkit.MODE_ENV) == "postgres"


def waiting_on(watcher: Any, table: str) -> int:
    """How many sessions wait for a lock on `table`."""
    row = watcher.execute("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = %s::regclass",
                          (table,)).fetchone()
    return int(row[0])


def test_locked_tokens_and_tasks_tables_delay_only_the_requests_that_need_them(
        pg_cluster: ChaosCluster, runs: Runs, ledger: Ledger, callers: ThreadPoolExecutor) -> None:
    """`LOCK TABLE tokens, tasks` for 10 s. What a user expects, asserted: a token this server has verified
    before is answered from memory (a revocation would reach it by notification, not by this table), so
    its command runs under the lock; a token it has never seen waits for the lock and then runs once; a task
    created under the lock waits (its row is written before its step's command goes) and then runs its step
    once; /health answers within 100 ms meanwhile and says `degraded` naming what waits; the device stays
    online past the heartbeat timeout."""
    import psycopg

    cluster = pg_cluster
    url = str(dbkit.server_db(cluster.db))
    cluster.device("alpha", runs)
    assert cluster.run("alpha", [runs.command("before")], ["before"], ledger) is not None  # its token now known

    def create_task() -> str:
        with cluster.client() as remote:
            return str(remote.create_task("one counted step", plan=[runs.step("task")], device="alpha")["id"])

    with cluster.http() as client, psycopg.connect(url, autocommit=True) as watcher:
        assert timed_health(client)[1]["database"] == "ok"
        locker = psycopg.connect(url)  # a transaction of its own: the lock lasts until its rollback
        try:
            locker.execute("LOCK TABLE tokens, tasks IN ACCESS EXCLUSIVE MODE")
            locked_at = time.monotonic()
            stranger = callers.submit(cluster.run, "alpha", [runs.command("stranger")], ["stranger"], ledger,
                                      token=cluster.other_token)
            task = callers.submit(create_task)
            wait_for(lambda: waiting_on(watcher, "tokens") > 0 and waiting_on(watcher, "tasks") > 0,
                     "the unknown token's lookup and the task's first save waiting on the locks", WAIT)
            known = cluster.run("alpha", [runs.command("known")], ["known"], ledger)
            assert time.monotonic() - locked_at < LOCKED_FOR_S, "the known token's command waited for the lock"
            assert known is not None and [r.status.value for r in known] == ["success"], known
            times: list[float] = []
            reasons: set[str] = set()
            while time.monotonic() - locked_at < LOCKED_FOR_S:
                elapsed, body = timed_health(client)
                times.append(elapsed)
                assert body["devices_online"] == 1, body
                if body["status"] == "degraded":
                    reasons.add(body["database"])
                time.sleep(REQUEST_GAP_S)  # a monitor's pace, not a wait for anything
            slow = [(round(t, 3), i) for i, t in enumerate(times) if t > HEALTH_BUDGET_S]
            assert len(times) > 20 and len(slow) <= len(times) * MAY_BE_LATE, \
                f"/health over {HEALTH_BUDGET_S * 1000:g} ms under the lock: {slow} of {len(times)}"
            assert not any(b - a == 1 for (_, a), (_, b) in itertools.pairwise(slow)), \
                f"/health late twice in a row under the lock: {slow}"
            # what waits is named: the token lookup on the store's pool, the task's save on the tasks table
            assert any("(Tokens." in r for r in reasons), reasons
            assert any("tasks table" in r for r in reasons), reasons
            assert cluster.status("alpha") in ("online", "busy")  # heartbeats went on past the timeout
            assert not stranger.done(), "a token never seen was answered through the lock on the tokens table"
            assert not task.done(), "a task was created before its row could be written"
            assert runs.counts()["stranger"] == 0 and runs.counts()["task"] == 0, runs.counts()
        finally:
            locker.rollback()
            locker.close()

        results = stranger.result(timeout=WAIT)
        assert results is not None and [r.status.value for r in results] == ["success"], results
        task_id = task.result(timeout=WAIT)
        wait_for(lambda: cluster.remote.task(task_id)["state"] == "done", "the task created under the lock done",
                 WAIT)
        wait_for(lambda: timed_health(client)[1]["status"] == "ok", "/health ok after the lock", WAIT)

    rows = {r["call_id"]: r["status"] for r in cluster.audit()}
    assert rows["call-known"] == rows["call-stranger"] == "success", rows
    check_invariants(cluster, runs, ledger)
    assert runs.counts() == {"before": 1, "known": 1, "stranger": 1, "task": 1}, runs.counts()


def test_locked_pairing_devices_and_tasks_tables_delay_only_the_requests_that_need_them(
        pg_cluster: ChaosCluster, runs: Runs, ledger: Ledger, callers: ThreadPoolExecutor) -> None:
    """`LOCK TABLE pairing, devices, tasks` for a few seconds. A device's pairing request, an admin's change of
    a device's tags and a read of a finished task (no longer in memory) each wait for the lock, on the store's
    threads; meanwhile /health answers within 100 ms and a command on the device runs. Once the lock is
    released each of them is answered, and what they wrote is there (nothing lost)."""
    import psycopg

    from tether.device.link.trust.device_key import DeviceKey

    cluster = pg_cluster
    url = str(dbkit.server_db(cluster.db))
    cluster.device("alpha", runs)
    with cluster.client() as remote:
        done_id = str(remote.create_task("one counted step", plan=[runs.step("task")], device="alpha")["id"])
    wait_for(lambda: cluster.remote.task(done_id)["state"] == "done", "the task done before the lock", WAIT)

    with cluster.http() as client, psycopg.connect(url, autocommit=True) as watcher:
        locker = psycopg.connect(url)  # a transaction of its own: the lock lasts until its rollback
        try:
            locker.execute("LOCK TABLE pairing, devices, tasks IN ACCESS EXCLUSIVE MODE")
            locked_at = time.monotonic()
            pairing = callers.submit(httpx.post, f"{cluster.url}/api/v1/pairing",
                                     json={"public_key": DeviceKey.generate().public_key, "name": "newcomer"},
                                     timeout=WAIT)
            tags = callers.submit(client.patch, "/devices/alpha", json={"tags": ["lab"]})
            read = callers.submit(client.get, f"/tasks/{done_id}")
            wait_for(lambda: all(waiting_on(watcher, t) > 0 for t in ("pairing", "devices", "tasks")),
                     "the pairing request, the tags' write and the task's read waiting on the locks", WAIT)
            during = cluster.run("alpha", [runs.command("during")], ["during"], ledger)
            assert during is not None and [r.status.value for r in during] == ["success"], during
            times = [timed_health(client)[0] for _ in range(10)]
            assert sorted(times)[len(times) // 2] <= HEALTH_BUDGET_S, f"/health under the lock: {times}"
            assert not (pairing.done() or tags.done() or read.done()), "answered through an exclusive lock"
            assert time.monotonic() - locked_at < LOCKED_FOR_S, "the command or /health waited for the lock"
        finally:
            locker.rollback()
            locker.close()

        code = pairing.result(timeout=WAIT).raise_for_status().json()["code"]
        assert tags.result(timeout=WAIT).raise_for_status().json()["tags"] == ["lab"]
        assert read.result(timeout=WAIT).raise_for_status().json()["state"] == "done"
        assert code in [p["code"] for p in client.get("/pairing").raise_for_status().json()]
        assert next(d for d in cluster.remote.devices() if d["name"] == "alpha")["tags"] == ["lab"]

    check_invariants(cluster, runs, ledger)
    assert runs.counts() == {"task": 1, "during": 1}, runs.counts()
