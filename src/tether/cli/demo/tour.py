"""`tether demo`: a short tour of a device in local mode that needs no LLM key and no network."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console

from tether.device.config import parse_device_config
from tether.device.local import open_local_device
from tether.protocol.models import Command, Result


def _show(console: Console, title: str, result: Result, expect_ok: bool, detail: str = "") -> None:
    as_expected = result.ok == expect_ok
    mark = "[green]✓[/green]" if as_expected else "[red]✗ unexpected:[/red]"
    outcome = result.status.value if result.ok or not as_expected else "refused, as it should be"
    console.print(f"{mark} {title}: [bold]{outcome}[/bold] {detail}")
    if result.error:
        console.print(f"    [dim]{result.error}[/dim]")


def demo_plan(work: Path) -> tuple[list[dict[str, Any]], Path]:
    """The demo task's plan (no LLM needed) and the file it writes. Its first step fails on purpose
    (`mkdir` of a nested folder without -p): recovery's fast path patches it and the task goes on."""
    folder = work / "demo" / "nested"
    hello = folder / "hello-world.txt"
    return [
        {"skill": "shell.run", "args": {"cmd": "mkdir", "argv": [str(folder)], "cwd": str(work)},
         "description": "create demo/nested"},
        {"skill": "write_file", "args": {"file_path": str(hello), "content": "hello from a tether task\n"},
         "description": "write hello-world.txt"},
        {"skill": "read_file", "args": {"file_path": str(hello)}, "description": "read it back"},
    ], hello


async def _task(console: Console, device: Any, work: Path) -> bool:
    """The demo plan as a task in this process, shown as `tether run --plan` shows it."""
    from tether.agent.planning.plan import Plan
    from tether.agent.run.executor import TaskRunner
    from tether.agent.run.task import Task
    from tether.cli.views.task import EventView, print_outcome

    steps, hello = demo_plan(work)
    task = Task(request="create demo/nested/hello-world.txt", plan=Plan.model_validate({"steps": steps}))
    view = EventView(console)
    dispatcher = device.dispatcher(session_id=task.id)
    computer = await device.computer_manager.get_or_create(None)

    async def nobody(question: Any) -> str:
        return "cancel"  # the demo plan asks nothing; if it did, the demo would stop rather than hang

    console.print("\n[bold]a task[/bold] from a plan (no LLM): tether run --plan …")
    runner = TaskRunner(lambda _name: dispatcher, None, tools={None: computer.tool_infos()}, ask=nobody,
                        on_event=lambda event: view(event.kind, event.data))
    await runner.run(task)
    print_outcome(console, task.state.value, task.answer, task.error, streamed=view.streamed)
    patched = any((r.decision or {}).get("decision") == "AUTO_PATCH" for r in task.steps)
    passed = task.state.value == "done" and patched and hello.read_text() == "hello from a tether task\n"
    console.print(f"{'[green]✓[/green]' if passed else '[red]✗ unexpected:[/red]'} the task ran, its failed "
                  f"mkdir patched by recovery ({task.state.value})")
    device.journal.restore(task.id, device.policy.write_roots)
    gone = not hello.exists()
    console.print(f"{'[green]✓[/green]' if gone else '[red]✗ unexpected:[/red]'} tether undo {task.id[:12]}: "
                  "the file it wrote is gone")
    return passed and gone


async def run_demo(console: Console, state_dir: Path | None = None) -> int:
    """Return 0 when every step behaved as expected (denials included), so CI can run it too."""
    raw: dict = {}
    if importlib.util.find_spec("mcp_server_time") is not None:
        raw["mcpServers"] = {"time": {"command": sys.executable, "args": ["-m", "mcp_server_time"],
                                      "toolType": "data_collection"}}
    config = parse_device_config(raw, "demo")
    work = Path(tempfile.mkdtemp(prefix="tether-demo-"))
    session = f"demo-{uuid.uuid4().hex[:8]}"
    state = state_dir or work / "state"
    console.print(f"[bold]tether demo[/bold] — local mode, working in {work}, session {session}\n")
    from tether.device.root import RUN_AS_ENV, demo_run_as

    run_as, note = demo_run_as(work)  # as root: who the device in this process runs commands as
    if note:
        console.print(note, markup=False, soft_wrap=True)
    if run_as:
        os.environ[RUN_AS_ENV] = run_as
    ok = True
    async with open_local_device(config, state_dir=state, policy_path=demo_policy(work, state),
                                 holder="tether demo") as device:
        computer = await device.computer_manager.get_or_create(None)
        infos = computer.tool_infos()
        namespaces = sorted({i.namespace for i in infos})
        console.print(f"{len(infos)} tools in namespaces {', '.join(namespaces)}")
        dispatcher = device.dispatcher(session_id=session)
        target = work / "hello.txt"
        steps: list[tuple[str, Command, bool]] = [
            ("system info", Command(tool_name="get_system_info", parameters={"info_type": "os"}), True),
            ("run a real process",
             Command(tool_name="shell.run", parameters={"cmd": "echo", "argv": ["hello from tether"],
                                                        "cwd": str(work)}), True),
            ("write a file", Command(tool_name="write_file",
                                     parameters={"file_path": str(target), "content": "first\n"}), True),
            ("overwrite it (journaled)", Command(tool_name="write_file", parameters={
                "file_path": str(target), "content": "second\n", "mode": "overwrite"}), True),
            ("policy refuses sudo", Command(tool_name="shell.run", parameters={
                "cmd": "sudo", "argv": ["id"], "cwd": str(work)}), False),
            ("policy refuses python -c", Command(tool_name="shell.run", parameters={
                "cmd": "python3", "argv": ["-c", "print(1)"], "cwd": str(work)}), False),
            ("wrong argument type", Command(tool_name="read_file", parameters={"file_path": 42}), False),
        ]
        if "time" in namespaces:
            steps.insert(2, ("external MCP server (mcp-server-time)",
                             Command(tool_name="get_current_time", parameters={"timezone": "UTC"}), True))
        for title, command, expect_ok in steps:
            [result] = await dispatcher.execute_commands([command], timeout=60)
            detail = ""
            if result.ok and isinstance(result.result, dict) and "stdout" in result.result:
                detail = repr(result.result["stdout"].strip())
            _show(console, title, result, expect_ok, detail)
            ok = ok and result.ok == expect_ok
        report = device.journal.restore(session, device.policy.write_roots)
        restored = target.read_text() if target.exists() else "<gone>"
        console.print(f"\n[bold]undo[/bold] {session}: {len(report)} change(s) put back; "
                      f"{target.name} now reads {restored!r}")
        console.print(f"(from a shell: [bold]tether undo {session} --state-dir {state}[/bold])")
        ok = await _task(console, device, work) and ok
    console.print("\n[green]demo finished[/green]" if ok else "\n[red]demo: a step misbehaved[/red]")
    return 0 if ok else 1


def demo_policy(work: Path, state: Path) -> Path:
    """The demo device's policy file (in `state`): the default one, with the demo's working directory (in the
    temp dir) as a write root of its own, so it is the machine's directory and not each session's private /tmp."""
    state.mkdir(parents=True, exist_ok=True)
    path = state / "demo-policy.json"
    path.write_text(json.dumps({"write_roots": ["~", tempfile.gettempdir(), str(work)]}))
    return path
