"""`tether run`, `tasks`, `log`, `answer`, `approve`, `undo` against a real server and device process.

The device runs with its own temp directory (TMPDIR) and a policy that jails it to two folders, so
deleting in `root` needs a person's approval while changing a file in `temp` does not.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.kits import db as dbkit
from tests.kits.netutil import CLI, HEARTBEAT, Cluster, wait_for
from tether.cli.common import parse_requires


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.root = tmp / "root"
        device_temp = tmp / "device-temp"
        # the tasks' shared files: a directory in the device's temp dir the policy names as a write root (the
        # machine's; the rest of the temp dir is each task's private /tmp)
        self.temp = device_temp / "shared"
        self.root.mkdir()
        self.temp.mkdir(parents=True)
        policy = tmp / "policy.yaml"
        roots = json.dumps([str(self.root), str(device_temp), str(self.temp)])
        policy.write_text(f"read_roots: {roots}\nwrite_roots: {roots}\n")
        self.cluster = Cluster(tmp)
        self.alpha = self.cluster.device("alpha", extra=("--policy", str(policy)), env={"TMPDIR": str(device_temp)})
        self.cluster.wait_online("alpha", self.alpha)
        self.env = {k: v for k, v in self.cluster.env.items() if not k.startswith(("TETHER_LLM_", "OPENAI_"))}
        self.env.update(TETHER_SERVER=f"http://127.0.0.1:{self.cluster.port}", TETHER_TOKEN=self.cluster.api_token)

    def tether(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, *args], capture_output=True, text=True, env=self.env, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def plan(self, name: str, steps: list[dict[str, Any]]) -> str:
        path = self.root.parent / name
        path.write_text(json.dumps(steps))
        return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = Setup(tmp_path_factory.mktemp("remote-tasks"))
    yield s
    s.cluster.close()


def task_id(output: str) -> str:
    found = re.search(r"^task ([0-9a-f]{32}) on ", output, re.M)
    assert found, output
    return found.group(1)


def shell(cmd: str, argv: list[str], cwd: Path) -> dict[str, Any]:
    return {"skill": "shell.run", "args": {"cmd": cmd, "argv": argv, "cwd": str(cwd)}}


def test_run_on_a_device_then_tasks_log_and_undo(setup: Setup) -> None:
    target = setup.root / "demo" / "sub"
    keep = setup.temp / "keep.txt"
    keep.write_text("original")
    plan = setup.plan("plan.json", [
        {**shell("mkdir", [str(target)], setup.root), "description": "make the folder (its parent is missing)"},
        {"skill": "write_file", "args": {"file_path": str(target / "hello.txt"), "content": "hi"}},
        {"skill": "write_file", "args": {"file_path": str(keep), "content": "changed", "mode": "overwrite"}},
        shell("echo", ["streamed from the device"], setup.root)])
    out = setup.tether("run", "--plan", plan, "--device", "alpha")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (target / "hello.txt").read_text() == "hi" and keep.read_text() == "changed"
    text = out.stdout
    assert "plan (given):" in text and "▶ step 1:" in text and "AUTO_PATCH" in text and "▶ step 4:" in text
    assert "│ streamed from the device" in text  # live output, as in local mode
    assert "answer:" in text and "4 of 4 step(s) succeeded" in text and "\ndone\n" in text
    assert "tether undo " in text
    tid = task_id(text)

    listed = setup.tether("tasks", "--json")
    assert listed.returncode == 0, listed.stderr
    row = next(r for r in json.loads(listed.stdout) if r["id"] == tid)
    assert row["state"] == "done" and row["device"] == "alpha"
    table = setup.tether("tasks")
    assert tid[:12] in table.stdout and "on http://127.0.0.1" in table.stdout
    log = setup.tether("log", tid[:10])
    assert log.returncode == 0, log.stderr
    assert f"task {tid} on alpha — done" in log.stdout and "step 1 attempt 2" in log.stdout
    assert "decision: AUTO_PATCH" in log.stdout and "step 4 attempt 1 shell.run" in log.stdout
    full = json.loads(setup.tether("log", tid, "--json").stdout)
    assert [s["result"]["status"] for s in full["steps"]] == ["failure"] + ["success"] * 4
    local = setup.tether("tasks", "--local", "--json")  # this machine's own store knows nothing of it
    assert local.returncode == 0 and tid not in local.stdout

    undone = setup.tether("undo", tid)
    assert undone.returncode == 0, undone.stdout + undone.stderr
    assert keep.read_text() == "original" and not (target / "hello.txt").exists()
    assert "alpha" in undone.stdout and "keep.txt" in undone.stdout
    report = json.loads(setup.tether("undo", tid, "--json").stdout)
    assert set(report["devices"]) == {"alpha"}


def test_approval_answered_in_advance_or_later(setup: Setup) -> None:
    first, second = setup.root / "old1", setup.root / "old2"
    for victim in (first, second):
        victim.mkdir()
        (victim / "f.txt").write_text("x")
    approved = setup.tether("run", "--plan", setup.plan("rm1.json", [shell("rm", ["-r", str(first)], setup.root)]),
                            "--device", "alpha", "--answer", "approve")
    assert approved.returncode == 0, approved.stdout + approved.stderr
    assert "needs your approval" in approved.stdout and "→ approve (from --answer)" in approved.stdout
    assert not first.exists()

    waiting = setup.tether("run", "--plan", setup.plan("rm2.json", [shell("rm", ["-r", str(second)], setup.root)]),
                           "-d", "alpha")
    assert waiting.returncode == 3, waiting.stdout + waiting.stderr
    tid = task_id(waiting.stdout)
    assert "no terminal to ask" in waiting.stdout and f"tether approve {tid}" in waiting.stdout
    task = setup.cluster.remote.task(tid, events=False)
    assert task["state"] == "waiting_for_user" and task["questions"][-1]["kind"] == "approval"
    assert second.exists()
    listed = json.loads(setup.tether("tasks", "--state", "waiting_for_user", "--json").stdout)
    assert [r["id"] for r in listed] == [tid]

    nothing_to_answer = setup.tether("answer", task_id(approved.stdout), "yes")
    assert nothing_to_answer.returncode != 0 and "has no open question" in nothing_to_answer.stderr
    ok = setup.tether("approve", tid[:8])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "approved" in ok.stdout
    followed = setup.tether("log", tid, "--follow")
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert "→ approve" in followed.stdout and followed.stdout.rstrip().endswith("done")
    assert not second.exists()
    again = setup.tether("approve", tid)
    assert again.returncode == 1 and "no action waiting for approval" in again.stderr


def test_bad_input_gets_clear_errors(setup: Setup) -> None:
    plan = setup.plan("one.json", [shell("echo", ["x"], setup.root)])
    nope = setup.tether("run", "--plan", plan, "--device", "nope")
    assert nope.returncode == 2 and "no device named 'nope'" in nope.stderr
    gpu = setup.tether("run", "--plan", plan, "--require", "gpu")
    assert gpu.returncode == 2 and "no device fits" in gpu.stderr and "GPU" in gpu.stderr
    bad = setup.tether("run", "--plan", plan, "--require", "colour=red")
    assert bad.returncode == 2 and "colour=red" in bad.stderr
    no_llm = setup.tether("run", "make a folder", "--device", "alpha")
    assert no_llm.returncode == 2 and "no LLM" in no_llm.stderr
    for args in (["log", "0000"], ["answer", "0000", "yes"], ["cancel", "0000"], ["undo", "0000"],
                 ["log", "0000", "--follow"]):
        out = setup.tether(*args)
        assert out.returncode == 1 and "no task '0000'" in out.stderr, (args, out.stdout, out.stderr)
    local_follow = setup.tether("log", "0000", "--follow", "--local")
    assert local_follow.returncode == 2 and "server" in local_follow.stderr
    mixed = setup.tether("run", "--plan", plan, "--device", "alpha", "--state-dir", str(setup.root))
    assert mixed.returncode == 2 and "--state-dir" in mixed.stderr
    ghost = setup.tether("run", "--plan", plan, "--device", "alpha", "--also", "ghost")
    assert ghost.returncode == 2 and "ghost" in ghost.stderr and "never registered" in ghost.stderr


def test_ctrl_c_detaches_and_the_task_goes_on_until_cancelled(setup: Setup) -> None:
    plan = setup.plan("slow.json", [shell("sleep", ["60"], setup.root)])
    log = setup.root.parent / "detach.log"
    with log.open("w") as sink:
        # a shell starts background jobs with SIGINT ignored and the child would inherit that: give it the
        # disposition a terminal user's `tether run` has, whatever started pytest
        proc = subprocess.Popen([*CLI, "run", "--plan", plan, "-d", "alpha"], stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=setup.env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            wait_for(lambda: "▶ step 1" in log.read_text(), "the step started", procs=(proc,))
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    tid = task_id(text)
    assert "detached" in text and f"tether log {tid} --follow" in text and f"tether cancel {tid}" in text
    assert setup.cluster.remote.task(tid, events=False)["state"] == "running"
    cancelled = setup.tether("cancel", tid[:12])
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert f"task {tid} is cancelled" in cancelled.stdout
    again = setup.tether("cancel", tid)
    assert again.returncode == 1 and "already ended" in again.stderr


def test_parse_requires() -> None:
    assert parse_requires(["gpu", "platform=linux", "tag=lab,gpu-box", "tool=browser.act"]) == {
        "gpu": True, "platform": "linux", "tags": ["lab", "gpu-box"], "tools": ["browser.act"]}
    assert parse_requires(["gpu=false", "tags=a", "tag=b"]) == {"gpu": False, "tags": ["a", "b"]}
    for bad in ("gpu=maybe", "platform", "colour=red"):
        with pytest.raises(ValueError, match="--require"):
            parse_requires([bad])


def test_a_killed_server_keeps_the_task_and_asks_what_to_do(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    try:
        cluster = s.cluster
        after = s.root / "then.txt"
        plan = s.plan("slow.json", [shell("sleep", ["60"], s.root),
                                    {"skill": "write_file", "args": {"file_path": str(after), "content": "2"}}])
        created = cluster.remote.create_task("sleep, then write", plan=json.loads(Path(plan).read_text()),
                                             device="alpha")
        tid = created["id"]
        # killed once the step's command was sent (its start is saved first, so a restart knows it may have run):
        # the device busy with it is that fact; a saved `step_started` alone may precede the send
        wait_for(lambda: any(e["kind"] == "step_started" for e in cluster.remote.task(tid)["events"])
                 and cluster.status("alpha") == "busy", "the sleep step sent to the device",
                 procs=(cluster.server.popen,))
        cluster.server.kill()
        cluster.server = cluster.start(["server", "--port", str(cluster.port), *dbkit.server_db_args(cluster.db),
                                        *HEARTBEAT, "--log-level", "warning"], "server-again")
        wait_for(lambda: cluster.remote.health()["status"] == "ok", "the new server's health",
                 procs=(cluster.server.popen,))
        cluster.wait_online("alpha", s.alpha)
        # the new server asks the device about the step first: it stopped the orphaned `sleep` on reconnecting
        wait_for(lambda: cluster.remote.task(tid)["state"] != "running", "the task settled",
                 procs=(cluster.server.popen,))

        log = s.tether("log", tid)
        assert log.returncode == 0, log.stderr
        assert "plan" in log.stdout and "shell.run {'cmd': 'sleep'" in log.stdout
        # the device's account: the orphaned `sleep` it stopped on reconnecting (a failure it reports), or, when its
        # stop had not been recorded yet as the server asked, no record of the call; either way it is asked about
        text = " ".join(log.stdout.split())  # `tether log` wraps long lines at the terminal's width
        stopped = ("step 1 attempt 1 shell.run {'cmd': 'sleep'" in text
                   and "→ failure: the server no longer waits for this batch" in text)
        assert stopped or "this device has no record of it" in text, log.stdout
        if stopped:  # its failure is the attempt's result; with no record the attempt has none to show
            assert "no result recorded" not in text
        assert "question (restart)" in text and "waiting for an answer" in text
        task = cluster.remote.task(tid)
        assert task["state"] == "waiting_for_user"
        question = task["questions"][-1]
        assert question["kind"] == "restart" and question["options"] == ["retry", "skip this step", "cancel"]
        assert "server_restarted" in [e["kind"] for e in task["events"]]

        # The device still runs the orphaned `sleep 60` (nobody cancels it) and runs one command at a time,
        # so the next step waits for it: this test takes about a minute.
        answered = s.tether("answer", tid, "skip")
        assert answered.returncode == 0, answered.stdout + answered.stderr
        followed = s.tether("log", tid, "--follow")
        assert followed.returncode == 0, followed.stdout + followed.stderr
        seen = " ".join(followed.stdout.split())
        assert "server restarted" in seen and "step 1 skipped" in seen
        assert seen.count("Retry the step, skip it, or cancel") == 1  # re-asked on resume, shown once
        assert seen.endswith("done")
        done = cluster.remote.task(tid, events=False)
        assert done["state"] == "done", done["error"]
        # the sleep was not run again: its one record is the outcome the device reported (none, when it had none)
        ran = [(st["step"]["skill"], st["attempt"]) for st in done["steps"]]
        assert ran == ([("shell.run", 1)] if stopped else []) + [("write_file", 1)], ran
        assert after.read_text() == "2"
    finally:
        s.cluster.close()
