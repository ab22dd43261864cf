"""Graph plans on a real `tether server` process with three real `tether device` processes (one server and
its devices for the whole module): parallel branches overlap, conditions pick edges, a branch fails and
recovers while its sibling runs on, a restarted server goes on without re-running finished steps, a running
graph is edited over the API (an edit refused for a cycle, one refused for a started step, one applied whose
new step starts at once), and `tether undo` puts back what a graph changed on two devices, in reverse order.

Steps are the chaos kit's counted commands: each appends its label to `runs.log` (how often it ran),
announces its start on a FIFO the test reads (an event, not a poll), and a gated one blocks until the
test opens its gate. So "both branches were running at once" is shown by both having started on their
devices while neither can end yet; nothing here sleeps.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.kits.chaos import WAIT, ChaosCluster, Runs, pids_running
from tests.kits.netutil import CLI, wait_for
from tether.client import Client
from tether.client.rest import RemoteError

NAMES = ("alpha", "beta", "gamma")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChaosCluster, Runs]]:
    tmp = tmp_path_factory.mktemp("graph")
    runs = Runs(tmp)
    (tmp / "work").mkdir()  # a captured write root: what steps change there, `tether undo` puts back
    runs.policy.write_text(runs.policy.read_text() + f"write_roots: [{str(tmp / 'work')!r}]\n")
    cluster = ChaosCluster(tmp, names=NAMES)
    try:
        for name in NAMES:
            cluster.device(name, runs)
        yield cluster, runs
    finally:
        cluster.close()
        runs.close()


def step(runs: Runs, label: str, device: str, needs: list[str] | None = None, *, gated: bool = False,
         **extra: Any) -> dict[str, Any]:
    return {**runs.step(label, gated=gated), "id": label, "device": device,
            **({"needs": needs} if needs is not None else {}), **extra}


def ended(cluster: ChaosCluster, task_id: str) -> dict[str, Any]:
    wait_for(lambda: cluster.remote.task(task_id, events=False)["state"] in ("done", "failed", "cancelled"),
             "the task ended", WAIT, (cluster.server.popen,))
    return cluster.remote.task(task_id)


def kinds(task: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e["data"] for e in task["events"] if e["kind"] == kind]


def test_branches_overlap_and_conditions_pick_the_edges(fleet: tuple[ChaosCluster, Runs]) -> None:
    cluster, runs = fleet
    plan = [step(runs, "p1", "alpha", [], gated=True),
            step(runs, "p2", "beta", [], gated=True),
            step(runs, "join", "gamma", ["p1", "p2"]),
            step(runs, "yes", "alpha", ["join"], when={"ref": "steps.join.result.stdout", "contains": "out:join"}),
            step(runs, "no", "beta", ["join"], when={"ref": "steps.join.result.stdout", "matches": "^nothing"}),
            step(runs, "onfail", "gamma", ["join"], when="failure"),
            step(runs, "last", "gamma", ["yes", "no"], when="always")]
    created = cluster.remote.create_task("two branches, then a join", plan=plan, device="alpha")
    runs.wait_started("p1")
    runs.wait_started("p2")  # both are running on their devices, and neither can end yet
    assert runs.open_gate("p1") and runs.open_gate("p2")
    task = ended(cluster, created["id"])
    assert task["state"] == "done", task["error"]
    events = [(e["kind"], e["data"].get("step")) for e in task["events"]
              if e["kind"] in ("step_started", "step_finished")]
    starts = {events.index(("step_started", 0)), events.index(("step_started", 1))}
    assert max(starts) < min(events.index(("step_finished", 0)), events.index(("step_finished", 1)))
    assert task["step_states"] == ["done", "done", "done", "done", "skipped", "skipped", "done"]
    skipped = {e["step"]: e["reason"] for e in kinds(task, "step_state") if e["state"] == "skipped"}
    assert "does not" not in skipped[4] and "matches '^nothing': no" in skipped[4]
    assert "only when a step it needs fails" in skipped[5]
    assert {lab: runs.counts()[lab] for lab in ("p1", "p2", "join", "yes", "no", "onfail", "last")} == \
        {"p1": 1, "p2": 1, "join": 1, "yes": 1, "no": 0, "onfail": 0, "last": 1}
    devices = {r["index"]: r["step"]["device"] for r in task["steps"]}
    assert devices == {0: "alpha", 1: "beta", 2: "gamma", 3: "alpha", 6: "gamma"}
    assert task["graph"]["width"] == 3 and [n["stage"] for n in task["graph"]["nodes"]] == [0, 0, 1, 2, 2, 2, 3]
    log = subprocess.run([*CLI, "log", task["id"], "--server", cluster.url], capture_output=True, text=True,
                         env={**cluster.env, "TETHER_TOKEN": cluster.api_token}, timeout=WAIT, check=True).stdout
    drawn = log[log.index("graph: 7 steps, up to 3 at once"):].splitlines()[:9]
    assert all(len(line) <= 80 for line in drawn), drawn
    assert drawn[4].strip().startswith("1 └─[+]  3 join") and "<- p1, p2" in drawn[4]
    assert "[-]  5 no" in drawn[6] and "(if steps.join.result.stdout)" in drawn[6] and "[+]  7 last" in drawn[8]


def test_a_branch_fails_and_recovers_while_its_sibling_runs(fleet: tuple[ChaosCluster, Runs]) -> None:
    cluster, runs = fleet
    target = cluster.tmp / "work" / "made" / "deeper" / "note.txt"  # no parent: recovery adds create_parents
    plan = [step(runs, "slow", "alpha", [], gated=True),
            {"id": "write", "needs": [], "device": "beta", "skill": "write_file",
             "args": {"file_path": str(target), "content": "hello"}},
            step(runs, "after", "gamma", ["slow", "write"])]
    created = cluster.remote.create_task("one branch fails and recovers", plan=plan, device="alpha")
    runs.wait_started("slow")
    wait_for(lambda: cluster.remote.task(created["id"], events=False)["step_states"][1] == "done",
             "the failing branch recovered", WAIT, (cluster.server.popen,))
    assert runs.counts()["after"] == 0  # the sibling is still running, so the join waits
    assert runs.open_gate("slow")
    task = ended(cluster, created["id"])
    assert task["state"] == "done", task["error"]
    attempts = [r for r in task["steps"] if r["index"] == 1]
    assert [a["result"]["status"] for a in attempts] == ["failure", "success"]
    assert kinds(task, "patched")[0]["args"]["create_parents"] is True
    assert target.read_text() == "hello"
    order = [(e["kind"], e["data"].get("step")) for e in task["events"]]
    assert order.index(("patched", 1)) < order.index(("step_finished", 0))  # recovered before the sibling ended


def test_a_device_is_chosen_by_requires_and_cancel_stops_every_branch(fleet: tuple[ChaosCluster, Runs]) -> None:
    cluster, runs = fleet
    plan = [{**runs.step("ch1", gated=True), "id": "ch1", "needs": [], "requires": {"name": "gamma",
                                                                                   "tools": ["shell.run"]}},
            step(runs, "ch2", "beta", [], gated=True),
            step(runs, "ch3", "alpha", ["ch1", "ch2"])]
    created = cluster.remote.create_task("choose a device, then cancel", plan=plan, device="alpha")
    tid = created["id"]
    runs.wait_started("ch1")
    runs.wait_started("ch2")
    task = cluster.remote.task(tid)
    [chosen] = kinds(task, "device_chosen")
    assert chosen["step"] == 0 and chosen["device"] == "gamma" and "shell.run" in chosen["why"]
    assert next(e for e in kinds(task, "step_started") if e["step"] == 0)["device"] == "gamma"
    cluster.remote.cancel(tid)
    task = ended(cluster, tid)
    assert task["state"] == "cancelled"
    for label in ("ch1", "ch2"):  # both running branches were stopped on their devices
        wait_for(lambda label=label: not pids_running(runs.script, label), f"{label} stopped", WAIT)
    assert runs.counts()["ch3"] == 0 and task["step_states"][2] == "pending"


def test_a_restarted_server_goes_on_without_re_running_finished_steps(fleet: tuple[ChaosCluster, Runs]) -> None:
    cluster, runs = fleet
    plan = [step(runs, "r1", "alpha", []), step(runs, "r2", "beta", [], gated=True),
            step(runs, "r3", "gamma", ["r1", "r2"], when="always"),
            {"id": "ask", "needs": [], "device": "alpha", "skill": "shell.run",  # fails: no LLM, a person decides
             "args": {"cmd": "ls", "argv": [str(runs.live / "no-such-file")], "cwd": str(runs.live)}}]
    created = cluster.remote.create_task("survive a restart", plan=plan, device="alpha")
    tid = created["id"]
    runs.wait_started("r2")
    wait_for(lambda: (t := cluster.remote.task(tid, events=False))["step_states"][0] == "done"
             and t["state"] == "waiting_for_user", "the first branch finished, the last one asks", WAIT,
             (cluster.server.popen,))
    cluster.kill_server()
    cluster.restart_server()
    for name in NAMES:
        cluster.wait_online(name)
    # the new server asks beta about the step in flight: beta stopped the orphaned run when it reconnected and
    # reports that failure, which r3 (`when: always`) handles; the branch that had finished is not run again
    runs.open_gate("r2")  # an orphan still waiting there ends
    # while the question stays open, the other branches go on: r3 runs
    wait_for(lambda: cluster.remote.task(tid, events=False)["step_states"][2] == "done", "r3 ran", WAIT,
             (cluster.server.popen,))
    task = cluster.remote.task(tid)
    assert task["state"] == "waiting_for_user" and task["questions"][-1]["step"] == 3
    cluster.remote.answer(tid, "skip")
    task = ended(cluster, tid)
    assert task["state"] == "done", task["error"]
    assert {lab: runs.counts()[lab] for lab in ("r1", "r2", "r3")} == {"r1": 1, "r2": 1, "r3": 1}
    assert task["step_states"] == ["done", "failed", "done", "skipped"]
    assert [e for e in kinds(task, "server_restarted") if e.get("graph")]
    assert next(e for e in kinds(task, "step_finished") if e.get("from_device"))["step"] == 1


def test_a_running_graph_is_edited_checked_whole_and_refused_with_the_reasons(
        fleet: tuple[ChaosCluster, Runs]) -> None:
    cluster, runs = fleet
    plan = [step(runs, "g1", "alpha", [], gated=True), step(runs, "g2", "beta", ["g1"]),
            step(runs, "g3", "gamma", ["g1"])]
    tid = cluster.remote.create_task("a graph edited while it runs", plan=plan, device="alpha")["id"]
    runs.wait_started("g1")
    cycle = runs.live / "cycle.json"  # `tether edit` reads YAML or JSON
    cycle.write_text(json.dumps({"add": [step(runs, "e0", "gamma", ["g2"])], "add_needs": {"g2": ["e0"]}}))
    refused = subprocess.run([*CLI, "edit", tid, "--file", str(cycle), "--server", cluster.url], capture_output=True,
                             text=True, env={**cluster.env, "TETHER_TOKEN": cluster.api_token}, timeout=WAIT)
    assert refused.returncode != 0 and "cycle" in refused.stderr and "Traceback" not in refused.stderr
    with pytest.raises(RemoteError) as started:
        cluster.remote.edit_task(tid, {"remove": ["g1"]})
    assert started.value.status == 409 and "has already running" in str(started.value)
    # applied at once: e1 starts while g1 still blocks, g3 is gone, and g2 now waits for e1 too
    with Client(cluster.url, cluster.api_token, timeout=WAIT) as client:
        applied = client.edit_task(tid, {"add": [step(runs, "e1", "gamma", [])], "remove": ["g3"],
                                         "add_needs": {"g2": ["e1"]}})
    assert applied["status"] == "applied" and applied["step_states"][2] == "removed"
    runs.wait_started("e1")
    assert runs.counts()["g2"] == 0
    assert runs.open_gate("g1")
    task = ended(cluster, tid)
    assert task["state"] == "done", task["error"]
    assert task["step_states"] == ["done", "done", "removed", "done"]
    assert {lab: runs.counts()[lab] for lab in ("g1", "g2", "g3", "e0", "e1")} == \
        {"g1": 1, "g2": 1, "g3": 0, "e0": 0, "e1": 1}
    order = [(e["kind"], e["data"].get("step")) for e in task["events"]]
    assert order.index(("step_finished", 3)) < order.index(("step_started", 1))  # the added need held g2
    reasons = [e["reasons"] for e in kinds(task, "edit_refused")]
    assert len(reasons) == 2 and any("cycle" in r for r in reasons[0])
    [edit] = kinds(task, "edit")
    assert edit["source"] == "api" and edit["by"] == "api:chaos" and edit["remove"] == ["g3"]
    with pytest.raises(RemoteError) as over:  # an ended task has no running graph
        cluster.remote.edit_task(tid, {"remove": ["g2"]})
    assert over.value.status == 409


def test_undo_puts_back_every_devices_changes_of_a_graph_in_reverse_order(
        fleet: tuple[ChaosCluster, Runs]) -> None:
    cluster, _ = fleet
    work = cluster.tmp / "work" / "undo"
    (work / "tree" / "sub").mkdir(parents=True)
    (work / "tree" / "sub" / "data.txt").write_text("made on alpha")
    shared = work / "shared.txt"
    shared.write_text("v0")
    plan = [{"id": "w1", "needs": [], "device": "alpha", "skill": "write_file",
             "args": {"file_path": str(shared), "content": "v1", "mode": "overwrite"}},
            {"id": "send", "needs": [], "device": "beta", "skill": "transfer",
             "args": {"from": "alpha", "source": str(work / "tree"), "dest": str(work / "copy")}},
            {"id": "w2", "needs": ["w1", "send"], "device": "beta", "skill": "write_file",
             "args": {"file_path": str(shared), "content": "v2", "mode": "overwrite"}}]
    tid = cluster.remote.create_task("change files on two devices", plan=plan, device="alpha")["id"]
    task = ended(cluster, tid)
    assert task["state"] == "done", task["error"]
    assert shared.read_text() == "v2" and (work / "copy" / "sub" / "data.txt").read_text() == "made on alpha"
    undone = subprocess.run([*CLI, "undo", tid, "--server", cluster.url, "--json"], capture_output=True, text=True,
                            env={**cluster.env, "TETHER_TOKEN": cluster.api_token}, timeout=WAIT)
    assert undone.returncode == 0, undone.stderr
    # beta changed last, so it is undone first (v2 → v1), then alpha (v1 → v0); the other order leaves v1
    assert shared.read_text() == "v0"
    assert not (work / "copy").exists() and (work / "tree" / "sub" / "data.txt").read_text() == "made on alpha"
    devices = [e["devices"] for e in kinds(cluster.remote.task(tid), "undone")][-1]
    assert list(devices) == ["beta", "alpha"] and all("error" not in r for r in devices.values()), devices


def test_a_step_whose_device_cannot_report_after_a_restart_is_put_to_the_person(
        fleet: tuple[ChaosCluster, Runs]) -> None:
    cluster, runs = fleet
    plan = [step(runs, "u1", "gamma", [], gated=True), step(runs, "u2", "alpha", ["u1"], when="always")]
    tid = cluster.remote.create_task("a step whose outcome is lost", plan=plan, device="alpha")["id"]
    runs.wait_started("u1")
    cluster.kill_server()
    cluster.devices["gamma"].kill()  # its record of finished calls goes with the process: it cannot report
    runs.open_gate("u1")  # a run the device left behind ends
    wait_for(lambda: not pids_running(runs.script, "u1"), "the orphaned u1 ended", WAIT)
    cluster.restart_server()
    cluster.device("gamma", runs)
    # u2 runs even when u1 fails (`when: always`), yet an unknown outcome is not a failure: a person says
    wait_for(lambda: cluster.remote.task(tid, events=False)["state"] == "waiting_for_user",
             "the unknown outcome is put to the person", WAIT, (cluster.server.popen,))
    task = cluster.remote.task(tid)
    [record] = [r for r in task["steps"] if r["index"] == 0]
    assert record["result"]["result"]["error_code"] == "restart_unknown", record["result"]
    assert "whether it finished is unknown" in record["result"]["error"]
    question = task["questions"][-1]
    assert question["step"] == 0 and {"retry", "cancel"} <= set(question["options"])
    assert runs.counts()["u1"] == 1 and runs.counts()["u2"] == 0  # u1 never re-run by itself, u2 waits
    cluster.remote.answer(tid, "skip")
    task = ended(cluster, tid)
    assert task["state"] == "done", task["error"]
    assert task["step_states"] == ["skipped", "done"] and runs.counts()["u1"] == 1


def test_an_edit_reaching_beyond_the_tokens_devices_is_refused(fleet: tuple[ChaosCluster, Runs]) -> None:
    cluster, runs = fleet
    secret = cluster.remote._request("POST", "/tokens", json={"kind": "api", "name": "alpha-only",
                                                              "scopes": ["read", "execute"], "devices": ["alpha"]})
    with cluster.client(secret["token"]) as attacker:
        tid = attacker.create_task("mine, on alpha", plan=[step(runs, "s1", "alpha", [], gated=True)],
                                   device="alpha")["id"]
        runs.wait_started("s1")
        tries = {"a step on gamma": {"add": [step(runs, "x1", "gamma", [])]},
                 "a sender on gamma": {"add": [{"id": "x2", "needs": [], "device": "alpha", "skill": "transfer",
                                                "args": {"from": "gamma", "source": "/etc", "dest": "/tmp/x"}}]},
                 "a device chosen later": {"add": [{**runs.step("x3"), "id": "x3", "needs": [],
                                                    "requires": {"tools": ["shell.run"]}}]}}
        for what, edit in tries.items():
            with pytest.raises(RemoteError) as refused:
                attacker.edit_task(tid, edit)
            assert refused.value.status == 403 and "scope" in str(refused.value), what
        assert attacker.edit_task(tid, {"add": [step(runs, "x4", "alpha", ["s1"])]})["status"] == "applied"
        assert runs.open_gate("s1")
        task = ended(cluster, tid)
    assert task["state"] == "done", task["error"]
    assert {lab: runs.counts()[lab] for lab in ("x1", "x3", "x4")} == {"x1": 0, "x3": 0, "x4": 1}
    assert not kinds(task, "edit_refused")  # refused before reaching the graph: nothing of them ran or was logged
