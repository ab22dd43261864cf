"""The server's state directory on a small tmpfs that fills up under real server and device processes.

While the audit cannot be written no command runs (a clear 503 naming the full disk, nothing reaches
the device), a command already running is still answered and its audit row is written once there is
space again, and everything works again after the space is freed. Mounting needs root (CI is) or a
private mount namespace (`unshare -rm`); the test never skips."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kits.chaos import WAIT, ChaosCluster, Ledger, Runs, check_invariants, fill, mount_tmpfs
from tether.client.rest import RemoteError

# the disk that fills is the server's SQLite file's; a PostgreSQL server keeps its state elsewhere
pytestmark = pytest.mark.sqlite_only(reason="fills the disk under the server's SQLite file")


@pytest.fixture
def disk() -> Iterator[Path]:
    # not under /tmp: the device's sandbox lays an overlay over its write roots (~ and /tmp)
    path = Path(tempfile.mkdtemp(prefix="tether-chaos-disk-", dir="/var/tmp"))
    try:
        mount_tmpfs(path, "8m")
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
        path.rmdir()


@pytest.fixture
def full_cluster(tmp_path: Path, disk: Path) -> Iterator[ChaosCluster]:
    c = ChaosCluster(tmp_path, state=disk / "state")
    yield c
    c.close()


def test_full_disk_runs_nothing_unaudited_and_recovers(full_cluster: ChaosCluster, disk: Path, runs: Runs,
                                                        ledger: Ledger, callers) -> None:
    cluster = full_cluster
    cluster.device("alpha", runs)
    call = callers.submit(cluster.run, "alpha", [runs.command("d1", gated=True)], ["d1"], ledger)
    runs.wait_started("d1")
    filler = fill(disk)
    assert runs.open_gate("d1")
    [result] = call.result(WAIT)
    assert result.ok, result  # it ran: its caller gets its result, its audit row is held

    refused = cluster.run("alpha", [runs.command("d2")], ["d2"], ledger)
    assert refused is None and "503" in ledger.sent[-1].caller_error and "disk full" in ledger.sent[-1].caller_error
    with pytest.raises(RemoteError, match="503") as task_refused:
        cluster.remote.create_task("refused", plan=[runs.step("d-task")], device="alpha")
    assert "disk full" in str(task_refused.value)
    assert runs.counts() == {"d1": 1}, "nothing runs while the audit cannot be written"

    filler.unlink()
    after = cluster.run("alpha", [runs.command("d3")], ["d3"], ledger)
    assert after is not None and after[0].ok, after
    assert cluster.remote.health()["status"] == "ok"
    assert runs.counts() == {"d1": 1, "d3": 1}
    check_invariants(cluster, runs, ledger)


def test_server_killed_while_audit_rows_are_held(full_cluster: ChaosCluster, disk: Path, runs: Runs,
                                                 ledger: Ledger, callers) -> None:
    """A command that ran while the disk was full has its outcome held in memory; a kill -9 before
    the disk frees must not leave a command that ran without an audit row. Its row was written as
    'sent' before it ran, and the restarted server marks it 'unknown': the one thing the log can know."""
    cluster = full_cluster
    cluster.device("alpha", runs)
    call = callers.submit(cluster.run, "alpha", [runs.command("e1", gated=True)], ["e1"], ledger)
    runs.wait_started("e1")
    filler = fill(disk)
    assert runs.open_gate("e1")
    [result] = call.result(WAIT)
    assert result.ok, result
    cluster.kill_server()
    filler.unlink()
    cluster.restart_server()
    cluster.wait_online("alpha")
    assert runs.counts() == {"e1": 1}
    check_invariants(cluster, runs, ledger, unknown_ok=frozenset({"e1"}))
