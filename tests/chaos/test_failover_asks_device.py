"""Fail-over asks the device first (issue 28, item 2), single server: `tether server` is killed (-9) while a
task's step runs on a real device process; the step finishes on the device while no server runs; the server
started again on the same port and database asks the device for the step's outcome, records it and goes on
without asking a person. The step ran exactly once (counted from a file) and its audit row is settled."""

from __future__ import annotations

from typing import Any

from tests.kits.chaos import WAIT, ChaosCluster, Ledger, Runs, check_invariants, pids_running
from tests.kits.netutil import wait_for


def step_call(task: dict[str, Any], index: int) -> str:
    [call_id] = {e["data"]["call_id"] for e in task["events"]
                 if e["kind"] == "step_started" and e["data"]["step"] == index}
    return str(call_id)


def test_a_step_that_finished_while_the_server_was_down_is_taken_from_the_device(
        cluster: ChaosCluster, runs: Runs, ledger: Ledger) -> None:
    cluster.device("alpha", runs)
    plan = [runs.step("t1"), runs.step("t2", gated=True), runs.step("t3")]
    tid = cluster.remote.create_task("three counted steps", plan=plan, device="alpha")["id"]
    runs.wait_started("t2")
    call_t2 = step_call(cluster.remote.task(tid), 1)
    cluster.kill_server()
    runs.open_gate("t2")  # the step ends on the device with no server to tell: its result waits there
    wait_for(lambda: not pids_running(runs.script, "t2"), "t2 finished on the device", WAIT)
    cluster.restart_server()
    cluster.wait_online("alpha")
    wait_for(lambda: cluster.remote.task(tid)["state"] in ("done", "failed", "cancelled", "waiting_for_user"),
             "the task settled", WAIT)
    task = cluster.remote.task(tid)
    assert task["state"] == "done", (task["state"], task.get("questions"), task.get("error"))
    assert not [q for q in task.get("questions", []) if q["kind"] == "restart"], task["questions"]
    assert runs.counts() == {"t1": 1, "t2": 1, "t3": 1}  # nothing ran twice, nothing was skipped
    [t2] = [s for s in task["steps"] if s["index"] == 1]
    assert t2["command"]["call_id"] == call_t2 and t2["result"]["status"] == "success"
    assert t2["result"]["result"]["stdout"] == "out:t2\n"  # the device's own result of that run
    assert any(e["kind"] == "step_finished" and e["data"].get("from_device") for e in task["events"])
    [row] = [r for r in cluster.audit() if r["call_id"] == call_t2]
    assert row["status"] == "success", row  # settled: not left `sent` or `unknown`
    check_invariants(cluster, runs, ledger)


def test_a_step_the_device_has_no_record_of_is_put_to_the_person(cluster: ChaosCluster, runs: Runs,
                                                                 ledger: Ledger) -> None:
    """The device that ran the step is gone (killed too) and a new process of it has no record: the outcome
    is really unknown, so the person is asked as before, and the question says why."""
    cluster.device("alpha", runs)
    plan = [runs.step("u1", gated=True), runs.step("u2")]
    tid = cluster.remote.create_task("two counted steps", plan=plan, device="alpha")["id"]
    runs.wait_started("u1")
    cluster.kill_server()
    cluster.devices["alpha"].kill()
    for pid in pids_running(runs.script, "u1"):  # what the killed device left behind
        runs.open_gate("u1")
        wait_for(lambda pid=pid: pid not in pids_running(runs.script, "u1"), "u1 ended", WAIT)
    cluster.restart_server()
    cluster.device("alpha", runs)
    task = wait_for(lambda: (t := cluster.remote.task(tid))["state"] == "waiting_for_user" and t,
                    "the restart question", WAIT)
    assert isinstance(task, dict)
    question = task["questions"][-1]
    assert question["kind"] == "restart" and question["options"] == ["retry", "skip this step", "cancel"]
    assert "unknown" in question["question"] and "no record" in question["question"], question["question"]
    cluster.remote.answer(tid, "skip")
    end = [data for kind, data in cluster.remote.task_events(tid) if kind == "end"]
    assert end and end[-1]["state"] == "done", end
    assert runs.counts() == {"u1": 1, "u2": 1}
    check_invariants(cluster, runs, ledger, unknown_ok=frozenset({"u1"}))
