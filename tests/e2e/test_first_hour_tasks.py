"""A first hour without surprises (issue 12 §2): local tasks end in a clear state whatever happens, a
person's answers are read one way, ids are taken by prefix, tasks.db is private. Real CLI processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from bench.kit.fake_llm import FakeLLM
from tests.kits.netutil import CLI, free_port
from tether.agent.run.replies import AnswerError, parse_answer
from tether.cli.views.terminal_output import TerminalLines


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "OPENAI_"))
           or k in ("TETHER_ALLOW_ROOT", "TETHER_RUN_AS")}  # the suite's root leave (conftest.py)
    # the tasks' files and cwd lie in the test's directory in /tmp: a write root of the device's policy (the rest of
    # /tmp is each task's private /tmp)
    config = tmp_path / "workspace-config.json"
    tmp_path.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps({"device": {"policy": {"write_roots": ["~", tempfile.gettempdir(), str(tmp_path)]}}}))
    return {**env, "TETHER_STATE_DIR": str(tmp_path / "state"), "NO_COLOR": "1", "COLUMNS": "200",
            "TETHER_CONFIG": str(config), **extra}


def _cli(tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=_env(tmp_path, **extra), timeout=120,
                          stdin=subprocess.DEVNULL)


def _tasks(tmp_path: Path) -> list[dict[str, str]]:
    listed = _cli(tmp_path, "tasks", "--json")
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)


def _ask_plan(tmp_path: Path) -> Path:
    """A plan whose first step fails with no LLM to fix it, so the task asks: retry, skip, cancel."""
    plan = tmp_path / "ask.yaml"
    plan.write_text(f"- skill: read_file\n  args: {{file_path: '{tmp_path}/missing.txt'}}\n"
                    f"- skill: write_file\n  args: {{file_path: '{tmp_path}/out.txt', content: hi}}\n")
    return plan


async def test_an_empty_plan_is_an_error_and_never_reaches_the_llm(tmp_path: Path) -> None:
    empty, no_steps = tmp_path / "empty.yaml", tmp_path / "none.json"
    empty.write_text("")
    no_steps.write_text('{"steps": []}')
    async with FakeLLM(["- skill: write_file"]) as fake:
        llm = {"TETHER_LLM_BASE_URL": fake.base_url, "TETHER_LLM_MODEL": "scripted"}
        for plan in (empty, no_steps):
            for where in ([], ["--server", f"http://127.0.0.1:{free_port()}"]):
                out = _cli(tmp_path, "run", "--plan", str(plan), *where, **llm)
                assert out.returncode == 2, out.stdout + out.stderr
                assert f"{plan}: the plan has no steps" in out.stderr and "Traceback" not in out.stderr
    assert fake.requests == []
    assert _tasks(tmp_path) == []


async def test_a_plan_the_llm_cannot_produce_ends_failed_in_one_line(tmp_path: Path) -> None:
    async with FakeLLM(["I would rather not."] * 6) as fake:  # the CLI runs apart: this loop serves the LLM
        proc = await asyncio.create_subprocess_exec(
            *CLI, "run", "tidy my notes", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            env=_env(tmp_path, TETHER_LLM_BASE_URL=fake.base_url, TETHER_LLM_MODEL="scripted"))
        stdout, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    text = stdout.decode()
    assert proc.returncode == 1 and "Traceback" not in text, text
    assert "failed: planning failed" in text
    [row] = _tasks(tmp_path)
    assert row["state"] == "failed"


def test_a_killed_local_run_is_interrupted_at_the_next_start_and_can_be_cancelled(tmp_path: Path) -> None:
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    plan = tmp_path / "block.yaml"
    plan.write_text(f"- skill: shell.run\n  args: {{cmd: cat, argv: ['{fifo}'], cwd: '{tmp_path}'}}\n")
    proc = subprocess.Popen([*CLI, "run", "--plan", str(plan)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, env=_env(tmp_path))
    try:
        seen = []
        assert proc.stdout is not None
        for line in proc.stdout:  # the step is running (cat waits on the FIFO) once this line is out
            seen.append(line)
            if "▶ step 1" in line:
                break
        else:
            pytest.fail("the step never started:\n" + "".join(seen))
        [running] = _tasks(tmp_path)  # a live run is never marked: its process holds the task's lock
        assert running["state"] == "running"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        with contextlib.suppress(OSError):  # let the orphaned cat end
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    [row] = _tasks(tmp_path)
    assert row["state"] == "interrupted", row
    log = _cli(tmp_path, "log", row["id"][:12])
    assert "interrupted" in log.stdout and "stopped before it ended" in log.stdout, log.stdout

    cancelled = _cli(tmp_path, "cancel", row["id"][:8])
    assert cancelled.returncode == 0 and f"task {row['id']} is cancelled" in cancelled.stdout, cancelled.stderr
    assert _tasks(tmp_path)[0]["state"] == "cancelled"
    again = _cli(tmp_path, "cancel", row["id"])
    assert again.returncode == 1 and "already ended (cancelled)" in again.stderr
    unknown = _cli(tmp_path, "cancel", "zzz")
    assert unknown.returncode == 1 and "no task 'zzz'" in unknown.stderr and "Traceback" not in unknown.stderr


def test_no_terminal_leaves_the_question_unanswered(tmp_path: Path) -> None:
    out = _cli(tmp_path, "run", "--plan", str(_ask_plan(tmp_path)))
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "left unanswered" in text and "cancelled by the user" not in text
    assert text.count("What should I do?") == 1  # the question once
    [row] = _tasks(tmp_path)
    assert row["state"] == "cancelled"


def test_an_out_of_range_answer_is_an_error_not_words_for_the_llm(tmp_path: Path) -> None:
    out = _cli(tmp_path, "run", "--plan", str(_ask_plan(tmp_path)), "--answer", "7", "--answer", "2")
    text = out.stdout + out.stderr
    assert "there is no option 7; choose 1 to 3" in text, text
    assert out.returncode == 0 and (tmp_path / "out.txt").read_text() == "hi"  # '2' skipped the failed step
    task = json.loads(_cli(tmp_path, "log", _tasks(tmp_path)[0]["id"], "--json").stdout)
    assert [q["answer"] for q in task["questions"]] == ["2"]


def test_enter_at_the_terminal_asks_again(tmp_path: Path) -> None:
    master, slave = os.openpty()
    try:
        os.write(master, b"\n2\n")  # Enter, then 'skip this step'
        out = subprocess.run([*CLI, "run", "--plan", str(_ask_plan(tmp_path))], stdin=slave, capture_output=True,
                             text=True, env=_env(tmp_path), timeout=120)
    finally:
        os.close(slave)
        os.close(master)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "the answer is empty; the options are: 1 retry, 2 skip this step, 3 cancel" in text
    assert "cancelled" not in text and (tmp_path / "out.txt").read_text() == "hi"


def test_one_answer_parser() -> None:
    approval = ["approve", "deny"]
    assert parse_answer(" yes ", approval, "approval") == "approve"
    assert parse_answer("n", approval, "approval") == "deny"
    assert parse_answer("2", approval, "approval") == "2"
    assert parse_answer("put it in /srv instead", ["retry", "cancel"]) == "put it in /srv instead"
    assert parse_answer("yes", ["retry", "cancel"]) == "yes"  # not an approval: words as they are
    for bad, says in (("", "the answer is empty"), ("   ", "the answer is empty"), ("3", "there is no option 3"),
                      ("0", "there is no option 0")):
        with pytest.raises(AnswerError, match=says):
            parse_answer(bad, approval, "approval")


def test_undo_takes_a_prefix_and_an_unknown_id_is_an_error(tmp_path: Path) -> None:
    target = tmp_path / "note.txt"
    target.write_text("before")
    plan = tmp_path / "write.yaml"
    plan.write_text(f"- skill: write_file\n  args: {{file_path: '{target}', content: after, mode: overwrite}}\n")
    ran = _cli(tmp_path, "run", "--plan", str(plan))
    assert ran.returncode == 0 and target.read_text() == "after", ran.stdout + ran.stderr
    task_id = _tasks(tmp_path)[0]["id"]

    unknown = _cli(tmp_path, "undo", "0123456789ab")
    assert unknown.returncode == 1 and "nothing to undo: no session or task '0123456789ab'" in unknown.stderr
    undone = _cli(tmp_path, "undo", task_id[:12])  # as `tether tasks` shows it
    assert undone.returncode == 0 and "restored" in undone.stdout, undone.stdout + undone.stderr
    assert target.read_text() == "before"

    cancelled = _cli(tmp_path, "run", "--plan", str(_ask_plan(tmp_path)), "--answer", "cancel")  # changes no file
    assert cancelled.returncode == 1, cancelled.stdout + cancelled.stderr
    quiet = next(r["id"] for r in _tasks(tmp_path) if r["id"] != task_id)
    none = _cli(tmp_path, "undo", quiet[:10])
    assert none.returncode == 0 and f"nothing to undo: task {quiet} changed no files" in none.stdout, none.stderr


def test_undo_says_when_a_prefix_names_several_sessions(tmp_path: Path) -> None:
    targets = []
    for i in range(2):
        target = tmp_path / f"n{i}.txt"
        target.write_text("x")
        targets.append(target)
        plan = tmp_path / f"w{i}.yaml"
        plan.write_text(f"- skill: write_file\n  args: {{file_path: '{target}', content: y, mode: overwrite}}\n")
        assert _cli(tmp_path, "run", "--plan", str(plan)).returncode == 0
    ids = [r["id"] for r in _tasks(tmp_path)]
    common = ""
    while len(common) < len(ids[0]) and ids[1].startswith(ids[0][:len(common) + 1]):
        common = ids[0][:len(common) + 1]
    out = _cli(tmp_path, "undo", common)  # '' when they share nothing: every session matches
    assert out.returncode == 1 and "the start of several sessions" in out.stderr, out.stdout + out.stderr
    assert all(t.read_text() == "y" for t in targets)


def test_tasks_db_is_only_its_owners(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    sqlite3.connect(state / "tasks.db").close()
    (state / "tasks.db").chmod(0o644)  # made by an older tether
    assert _cli(tmp_path, "tasks").returncode == 0
    assert stat.S_IMODE((state / "tasks.db").stat().st_mode) == 0o600

    fresh = tmp_path / "fresh"
    out = _cli(fresh, "run", "--plan", str(_ask_plan(tmp_path)), "--answer", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    for name in (fresh / "state").glob("tasks.db*"):
        assert stat.S_IMODE(name.stat().st_mode) == 0o600, name


def test_log_shows_each_steps_result_and_what_a_question_got(tmp_path: Path) -> None:
    plan = tmp_path / "say.yaml"
    plan.write_text(f"- skill: read_file\n  args: {{file_path: '{tmp_path}/missing.txt'}}\n"
                    "- skill: shell.run\n"
                    f"  args: {{cmd: printf, argv: ['first line\\nsecond\\n'], cwd: '{tmp_path}'}}\n")
    ran = _cli(tmp_path, "run", "--plan", str(plan), "--answer", "2")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    log = _cli(tmp_path, "log", _tasks(tmp_path)[0]["id"][:12])
    assert log.returncode == 0, log.stderr
    assert "result: exit 0, stdout: first line (+1 lines)" in log.stdout, log.stdout
    assert 'decision: ASK_USER: asked "Step 1 (read_file) failed' in log.stdout
    assert "What should I do?\" → answered: 2 (skip this step)" in log.stdout


def test_terminal_lines_join_chunks_and_rewrite_on_carriage_return() -> None:
    shown: list[tuple[str, str]] = []
    lines = TerminalLines(lambda stream, line: shown.append((stream, line)))
    for chunk in ("downloading:", "   0%", "\rdownloading:  25%", "\rdownloading: 100%\nhalf a", " line\r\n"):
        lines.feed("call-1", "stdout", chunk)
    lines.feed("call-1", "stderr", "warn")
    lines.feed("call-1", "stdout", "no end")
    assert shown == [("stdout", "downloading: 100%"), ("stdout", "half a line")]
    lines.feed("call-1", "stdout", "\rNO")  # overwrites the start only, as a terminal does
    lines.flush("call-2")
    assert len(shown) == 2
    lines.flush()
    assert shown[2:] == [("stdout", "NO end"), ("stderr", "warn")]


def test_run_shows_a_progress_bar_and_partial_writes_as_a_terminal_would(tmp_path: Path) -> None:
    script = ("import sys\n"
              "w = sys.stdout\n"
              "w.write('downloading:'); w.flush()\n"
              "for p in (0, 25, 100):\n"
              "    w.write(f'\\rdownloading: {p:3d}%'); w.flush()\n"
              "w.write('\\nhalf a'); w.flush()\n"
              "w.write(' line\\n'); w.flush()\n")
    (tmp_path / "bar.py").write_text(script)
    plan = tmp_path / "bar.json"
    plan.write_text(json.dumps([{"skill": "shell.run", "args": {"cmd": "python3", "argv": [str(tmp_path / "bar.py")],
                                                                "cwd": str(tmp_path)}}]))
    out = _cli(tmp_path, "run", "--plan", str(plan))
    assert out.returncode == 0, out.stdout + out.stderr
    shown = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("│")]
    assert shown == ["│ downloading: 100%", "│ half a line"], out.stdout
