"""One server per state (issue 28, "Outcomes are facts", item 3).

Found by an attacker on the landed code: a second `tether server` started by mistake ran its whole start-up
before it failed to bind, and on the way rewrote the running server's in-flight audit rows to `unknown`
(those commands succeeded; the rows stayed wrong); two servers on one state disagreed about a task; two
cluster nodes took one id silently; nodes started together on a fresh PostgreSQL database raced on its
schema and one died.

Real processes: a `tether server` with a real device running a command that blocks on a FIFO the test opens
(not a sleep); second servers that must fail with one line, exit 2, and change nothing; cluster nodes on a
private PostgreSQL (bench/kit/engines.py) and redis-server.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench.kit.engines import Engine, postgres_server, redis_server
from tests.kits import db as dbkit
from tests.kits.chaos import WAIT, ChaosCluster, Ledger, Runs, check_invariants
from tests.kits.netutil import CLI, Proc, free_port, tether_env, wait_for
from tether.client.rest import RemoteServer

READY = "Uvicorn running on"


def refused(args: list[str], env: dict[str, str]) -> str:
    """Run a `tether server` that must be refused: exit 2 and one line on stderr, no traceback; that line."""
    done = subprocess.run([*CLI, "server", *args, "--log-level", "warning"], env=env, capture_output=True, text=True,
                          timeout=WAIT)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, (done.returncode, done.stderr)
    assert READY not in done.stderr + done.stdout
    return errors[0]


def test_a_second_server_changes_nothing_and_the_first_ones_command_ends_as_it_ran(
        cluster: ChaosCluster, runs: Runs, ledger: Ledger, callers: ThreadPoolExecutor, tmp_path: Path) -> None:
    cluster.device("alpha", runs)
    # it runs while four more server processes start (three refused, one node): on a loaded machine that
    # passed the default 30 s batch timeout, and the command then ended `late`, not as it ran
    call = callers.submit(cluster.run, "alpha", [runs.command("long", gated=True)], ["long"], ledger,
                          timeout=4 * WAIT)
    runs.wait_started("long")
    before = cluster.audit()
    [row] = [r for r in before if r["call_id"] == "call-long"]
    assert row["status"] == "sent", row
    db = dbkit.server_db_args(cluster.db)

    # the same state on the same port: the lease refuses it before it reads a row or tries the port
    line = refused(["--port", str(cluster.port), *db], cluster.env)
    assert f"pid {cluster.server.pid}, listening on 127.0.0.1:{cluster.port}" in line and "already serves" in line
    # the same state on another port: the same refusal (two servers on one state disagree about its tasks)
    other_port = free_port()
    line = refused(["--port", str(other_port), *db], cluster.env)
    assert f"pid {cluster.server.pid}" in line, line
    # its own state on the running server's port: it binds before it opens its database, which it never creates
    elsewhere = tmp_path / "elsewhere"
    line = refused(["--port", str(cluster.port), *dbkit.server_db_args(elsewhere / "server.db")], tether_env(elsewhere))
    assert f"cannot listen on 127.0.0.1:{cluster.port}: the port is in use" in line, line
    if dbkit.backend() == "sqlite":
        assert not (elsewhere / "server.db").exists()

    assert cluster.audit() == before, "a refused server changed the running one's audit log"
    # a server with its own state directory on the same database is another node (docs/scaling.md): it starts,
    # and, not alone on the database, leaves the rows in flight to the server that sent them
    node = Proc(["server", "--port", str(other_port), *db, "--log-level", "warning"], tmp_path / "node-b.log",
                tether_env(tmp_path / "node-b"))
    try:
        with RemoteServer(f"http://127.0.0.1:{other_port}", cluster.api_token) as remote:
            wait_for(lambda: remote.health()["status"] == "ok", "the second node's health", WAIT, (node.popen,))
        assert cluster.audit() == before, "a second node settled the first one's rows in flight"
    finally:
        node.stop()
    assert runs.open_gate("long")
    [result] = call.result(WAIT)
    assert result.ok and result.result["stdout"] == "out:long\n", result
    [row] = [r for r in cluster.audit() if r["call_id"] == "call-long"]
    assert (row["status"], row["error"]) == ("success", None), row
    assert runs.counts() == {"long": 1}
    check_invariants(cluster, runs, ledger)

    # the lease dies with its process: a server killed -9 is followed at once by the next one, which (alone on
    # the database) settles only what was really left in flight
    cluster.kill_server()
    cluster.restart_server()
    assert [r["status"] for r in cluster.audit() if r["call_id"] == "call-long"] == ["success"]


# -- cluster nodes on one PostgreSQL database ---------------------------------------------------------------


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Engine, Engine]]:
    with postgres_server() as pg, redis_server() as redis:
        yield pg, redis


def fresh_database(pg: Engine, name: str) -> str:
    """A new, empty database (no schema at all) of the private PostgreSQL."""
    dbkit.psql(pg.url, f"CREATE DATABASE {name}")
    return dbkit.database_url(pg.url, name)


class Node:
    """A `tether server --cluster … --node-id NAME` process; `ready()` waits for its listening line."""

    def __init__(self, tmp: Path, name: str, db: str, redis: Engine) -> None:
        state = tmp / f"state-{name}-{free_port()}"
        state.mkdir()
        self.port = free_port()
        self.proc = subprocess.Popen([*CLI, "server", "--port", str(self.port), "--db", db, "--cluster",
                                      f"redis://127.0.0.1:{redis.port}/0", "--node-id", name,
                                      "--log-level", "info"],
                                     env=tether_env(state), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.seen = b""

    def ready(self, timeout: float = 60.0) -> None:
        """Block until the node says it listens."""
        self.wait_for(READY, timeout)

    def wait_for(self, text: str, timeout: float = WAIT) -> None:
        """Block until the node writes `text` on its stderr (its own line: an event, not a poll)."""
        assert self.proc.stderr is not None
        end = time.monotonic() + timeout
        while text.encode() not in self.seen:
            left = end - time.monotonic()
            readable, _, _ = select.select([self.proc.stderr], [], [], max(left, 0))
            chunk = os.read(self.proc.stderr.fileno(), 65536) if readable else b""
            if not chunk:
                raise AssertionError(f"node did not write {text!r} (exit {self.proc.poll()}): "
                                     f"{self.seen.decode(errors='replace')[-3000:]}")
            self.seen += chunk

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_a_node_id_in_use_is_refused_and_nodes_started_at_once_on_a_fresh_database_all_come_up(
        engines: tuple[Engine, Engine], tmp_path: Path) -> None:
    pg, redis = engines
    db = fresh_database(pg, "fresh_cluster")
    nodes = [Node(tmp_path, f"n{i}", db, redis) for i in range(4)]  # at the same moment, on no schema yet
    try:
        for node in nodes:
            node.ready()
        tables = dbkit.psql(db, "SELECT count(*) FROM schema_version").strip()
        assert int(tables) >= 1  # migrated once: each version recorded once
        assert dbkit.psql(db, "SELECT count(*) - count(DISTINCT version) FROM schema_version").strip() == "0"

        before = dbkit.psql(db, "SELECT count(*), max(id) FROM audit")
        env = tether_env(tmp_path / "state-other")
        line = refused(["--port", str(free_port()), "--db", db, "--cluster", f"redis://127.0.0.1:{redis.port}/0",
                        "--node-id", "n1"], env)
        assert line.startswith("error: node id n1 is already taken by another tether server (pid ") and \
            f"listening on 127.0.0.1:{nodes[1].port})" in line and "--node-id" in line, line
        assert dbkit.psql(db, "SELECT count(*), max(id) FROM audit") == before
        assert all(node.proc.poll() is None for node in nodes)

        # the database ends n2's lease session (as a restart of PostgreSQL would): n2 takes its lease again
        ended = dbkit.psql(pg.url, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                   "WHERE application_name LIKE 'tether server pid=% node=n2'").strip()
        assert ended == "1"
        nodes[2].wait_for("lease on its state was lost (the database's session ended) and is held again")
        line = refused(["--port", str(free_port()), "--db", db, "--cluster", f"redis://127.0.0.1:{redis.port}/0",
                        "--node-id", "n2"], env)
        assert f"listening on 127.0.0.1:{nodes[2].port})" in line, line
    finally:
        for node in nodes:
            node.stop()
    # and when its holder is gone, the id is free at once
    again = Node(tmp_path, "n1", db, redis)
    try:
        again.ready()
    finally:
        again.stop()
