"""The status line: while the LLM plans (with its streamed token count) or a step runs, a terminal shows
what is going on and for how long; nothing of it reaches a pipe. The real CLI runs on a real pty."""

from __future__ import annotations

import asyncio
import io
import json
import os
import pty
from pathlib import Path

from rich.console import Console

from bench.kit.fake_llm import FakeLLM
from tests.kits.netutil import CLI, workspace_policy
from tether.cli.views.spinner import Spinner
from tether.cli.views.task import EventView


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_line_shows_label_elapsed_time_and_tokens() -> None:
    clock, stream = Clock(), Tty()
    spinner = Spinner(stream, clock=clock)
    assert spinner.enabled
    spinner.set("planning")
    clock.now += 1.5
    spinner.count(32)
    assert stream.getvalue().endswith("\r\x1b[K⠋ planning … 1.5 s, 32 tokens")
    spinner.stop()
    assert stream.getvalue().endswith("\r\x1b[K") and spinner.label is None
    spinner.count(48)  # nothing shown once stopped
    assert stream.getvalue().endswith("\r\x1b[K")


def test_nothing_on_a_pipe() -> None:
    stream = io.StringIO()
    spinner = Spinner(stream)
    spinner.set("planning")
    spinner.count(5)
    spinner.stop()
    assert not spinner.enabled and stream.getvalue() == ""


def test_events_drive_the_line_and_output_erases_it_first() -> None:
    clock, line, printed = Clock(), Tty(), io.StringIO()
    spinner = Spinner(line, clock=clock)
    view = EventView(Console(file=printed, width=200, color_system=None), spinner=spinner)
    view("planning", {"from_step": 0, "recovery_context": None})
    assert spinner.label == "planning"
    view("planning_progress", {"tokens": 16})
    assert spinner.tokens == 16 and "planning … 0.0 s, 16 tokens" in line.getvalue()
    assert printed.getvalue() == ""  # progress is for the line only
    view("plan", {"steps": [{"skill": "shell.run", "args": {}}], "source": "llm"})
    assert spinner.label is None
    view("step_started", {"step": 0, "attempt": 1, "skill": "shell.run", "args": {"cmd": "sleep"}})
    assert spinner.label == "step 1: shell.run"
    before = len(line.getvalue())
    view("output", {"step": 0, "data": "working\n"})
    assert line.getvalue()[before:] == "\r\x1b[K" and "working" in printed.getvalue()
    assert spinner.label == "step 1: shell.run"  # still running: drawn again on the next tick
    view("planning", {"from_step": 1, "observing": True})
    assert spinner.label == "planning the next part from what was seen"
    view("step_finished", {"step": 0, "attempt": 1, "status": "success"})
    assert spinner.label is None


async def test_real_terminal_shows_planning_tokens_and_the_running_step(tmp_path: Path) -> None:
    # the line is drawn as soon as planning or a step starts (then each tick), so even a quick step shows it
    plan = {"steps": [{"skill": "shell.run", "args": {"cmd": "echo", "argv": ["hello"], "cwd": str(tmp_path)},
                       "description": "say hello, with a long description so that the plan streams in many "
                                      "chunks of a few characters each"}]}
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_LLM_", "OPENAI_", "TETHER_SERVER"))}
    seen = bytearray()
    ended = asyncio.Event()
    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        if not chunk:
            loop.remove_reader(master)
            ended.set()
            return
        seen.extend(chunk)

    async with FakeLLM([json.dumps(plan), "It said hello."]) as fake:
        proc = await asyncio.create_subprocess_exec(
            *CLI, "run", "--policy", str(workspace_policy(tmp_path)), "say hello", stdin=slave, stdout=slave,
            stderr=slave,
            env={**env, "TETHER_STATE_DIR": str(tmp_path / "state"), "TETHER_LLM_BASE_URL": fake.base_url,
                 "TETHER_LLM_MODEL": "scripted", "COLUMNS": "200"})
        os.close(slave)
        loop.add_reader(master, readable)
        try:
            assert await asyncio.wait_for(proc.wait(), timeout=120) == 0
            await asyncio.wait_for(ended.wait(), timeout=30)  # the rest of the output, to EOF
        finally:
            loop.remove_reader(master)
            os.close(master)
    text = seen.decode(errors="replace")
    assert "planning \u2026" in text and "16 tokens" in text, text
    assert "step 1: shell.run \u2026" in text and "It said hello." in text, text
    assert fake.requests[0].get("stream") is True  # the plan was streamed to count its tokens


async def test_a_server_task_reports_its_planning_tokens_to_followers(tmp_path: Path) -> None:
    from tests.kits.task import AgentServer
    from tether.tools.policy.model import default_policy

    root = tmp_path / "alpha"
    root.mkdir()
    policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
    plan = {"steps": [{"skill": "list_dir", "args": {"path": str(root)},
                       "description": "list the folder, described at length so that the plan streams in many chunks"}]}
    async with FakeLLM([json.dumps(plan), "Listed."]) as fake, AgentServer(tmp_path, llm=fake.settings()) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        created = await server.create(request="list the folder", device="alpha")
        events = await server.events_until(created["id"], lambda e: False)
    progress = [e["data"]["tokens"] for e in events if e["kind"] == "planning_progress"]
    assert progress and progress == sorted(progress) and progress[0] == 16
    assert fake.requests[0].get("stream") is True
