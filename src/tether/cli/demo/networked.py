"""The networked demo: a real `tether server` and `tether device`, each its own process, on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from tether.cli.demo.tour import demo_policy
from tether.client.rest import RemoteError, RemoteServer
from tether.protocol.messages import Event
from tether.protocol.models import Command, Result


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until(check, what: str, deadline_s: float, procs: list[subprocess.Popen]) -> None:
    """Poll `check` until it holds; fail early (with the process's exit) if a child died."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{what}: a demo process exited with code {proc.returncode}")
        try:
            if check():
                return
        except RemoteError:
            pass
        time.sleep(0.05)  # poll interval while a child process starts
    raise RuntimeError(f"{what}: not ready after {deadline_s:.0f}s")


def _show(console: Console, title: str, result: Result, expect_ok: bool) -> bool:
    as_expected = result.ok == expect_ok
    mark = "[green]✓[/green]" if as_expected else "[red]✗ unexpected:[/red]"
    outcome = result.status.value if result.ok or not as_expected else f"{result.status.value}, as it should be"
    detail = ""
    if result.ok and isinstance(result.result, dict) and "stdout" in result.result:
        lines = result.result["stdout"].strip().splitlines()
        detail = f"(stdout: {len(lines)} lines, streamed above)" if len(lines) > 1 else repr("".join(lines))
    console.print(f"{mark} {title}: [bold]{outcome}[/bold] {detail}")
    if result.error:
        console.print(f"    [dim]{result.error[:200]}[/dim]")
    return as_expected


def _task(console: Console, remote: RemoteServer, work: Path) -> bool:
    """The demo task (see `demo_plan`), created on the server, followed live, then undone on its device."""
    from tether.cli.commands.tasks.task import follow
    from tether.cli.demo.tour import demo_plan

    plan, hello = demo_plan(work)
    console.print("\n[bold]a task[/bold] from a plan (no LLM): tether run --plan … --device demo-device")
    summary = remote.create_task("create demo/nested/hello-world.txt", plan=plan, device="demo-device")
    code = follow(remote, summary["id"], console, answers=[])
    task = remote.task(summary["id"], events=False)
    patched = any((r.get("decision") or {}).get("decision") == "AUTO_PATCH" for r in task["steps"])
    ok = _check(console, "the task ran, its failed mkdir patched by recovery", code == 0 and patched
                and hello.read_text() == "hello from a tether task\n")
    undone = remote.undo_task(summary["id"])
    restored = undone["devices"].get("demo-device", {}).get("restored")
    return _check(console, f"tether undo {summary['id'][:12]}: the file it wrote is gone",
                  bool(restored) and not hello.exists()) and ok


def _check(console: Console, title: str, passed: bool) -> bool:
    console.print(f"{'[green]✓[/green]' if passed else '[red]✗ unexpected:[/red]'} {title}")
    return passed


def run_remote_demo(console: Console, state_dir: Path | None = None) -> int:
    from tether.server.store import Store

    work = Path(tempfile.mkdtemp(prefix="tether-demo-"))
    state = state_dir or work / "state"
    state.mkdir(parents=True, exist_ok=True)
    db = state / "server.db"
    store = Store(str(db))
    _, device_token = store.tokens.create("device", "demo-device", [])
    _, api_token = store.tokens.create("api", "demo-cli", ["read", "execute", "admin"])
    store.close()
    port = _free_port()
    env = {**os.environ, "TETHER_STATE_DIR": str(state)}
    cli = [sys.executable, "-m", "tether.cli"]
    console.print(f"[bold]tether demo[/bold] — a server and a device as two processes on 127.0.0.1:{port}\n")
    from tether.device.root import RUN_AS_ENV, demo_run_as

    run_as, note = demo_run_as(work)  # as root: the device is told it may, and who its commands run as
    if note:
        console.print(note, markup=False, soft_wrap=True)
    as_root = ["--allow-root"] if run_as else []
    device_env = {**env, "TETHER_DEVICE_TOKEN": device_token, **({RUN_AS_ENV: run_as} if run_as else {})}
    procs: list[subprocess.Popen] = []
    ok = True
    try:
        procs.append(subprocess.Popen([*cli, "server", "--port", str(port), "--db", str(db), "--log-level",
                                       "warning"], env=env))
        remote = RemoteServer(f"http://127.0.0.1:{port}", api_token)
        _wait_until(lambda: remote.health()["status"] == "ok", "server", 30, procs)
        console.print(f"server up (pid {procs[0].pid})")
        procs.append(subprocess.Popen([*cli, "device", "--server", f"ws://127.0.0.1:{port}", "--name", "demo-device",
                                       "--state-dir", str(state), "--policy", str(demo_policy(work, state)),
                                       *as_root],  # the token in its environment,
                                      env=device_env, stderr=subprocess.DEVNULL))  # which it clears
        _wait_until(lambda: any(d["name"] == "demo-device" and d["status"] != "offline"
                                for d in remote.devices()), "device registration", 60, procs)
        [info] = [d for d in remote.devices() if d["name"] == "demo-device"]
        console.print(f"device registered (pid {procs[1].pid}): {info['platform']}, "
                      f"capabilities {', '.join(info['capabilities'])}, sandbox {info.get('sandbox') or 'none'}")
        console.print(f"{len(remote.tools('demo-device'))} tools on demo-device\n")

        def stream(event: Event) -> None:
            if event.kind == "output":
                for line in str(event.data.get("data", "")).rstrip("\n").splitlines():
                    console.print(f"    │ {line}", style="dim", markup=False, highlight=False)

        target = work / "hello.txt"
        steps = [
            ("system info over AIP", [Command(tool_name="get_system_info", parameters={"info_type": "os"})], [True]),
            ("shell.run with live output", [Command(tool_name="shell.run", parameters={
                "cmd": "ls", "argv": ["-la", str(work)], "cwd": str(work)})], [True]),
            ("write then read a file", [
                Command(tool_name="write_file", parameters={"file_path": str(target), "content": "hi\n"}),
                Command(tool_name="read_file", parameters={"file_path": str(target)})], [True, True]),
            ("the sandbox: a write outside the write roots fails", [Command(tool_name="shell.run", parameters={
                "cmd": "touch", "argv": ["/etc/tether-demo"], "cwd": str(work)})], [False]),
            ("the sandbox: ps sees only itself, not the device", [Command(tool_name="shell.run", parameters={
                "cmd": "ps", "argv": ["-e", "-o", "pid,args"], "cwd": str(work)})], [True]),
            ("policy refuses sudo; the rest is skipped", [
                Command(tool_name="shell.run", parameters={"cmd": "sudo", "argv": ["id"], "cwd": str(work)}),
                Command(tool_name="shell.run", parameters={"cmd": "echo", "argv": ["never"], "cwd": str(work)})],
             [False, False]),
        ]
        for title, commands, expected in steps:
            _, results = remote.run("demo-device", commands, timeout=60, session_id="demo", on_event=stream)
            for index, (result, expect_ok) in enumerate(zip(results, expected, strict=True)):
                label = title if len(results) == 1 else f"{title} [{index + 1}/{len(results)}]"
                ok = _show(console, label, result, expect_ok) and ok
        ok = _task(console, remote, work) and ok
        rows = RemoteServer(f"http://127.0.0.1:{port}", api_token).devices()
        listing = ", ".join(f"{d['name']} ({d['status']})" for d in rows)
        console.print(f"\ndevices: {listing}")
    except (RuntimeError, RemoteError) as exc:
        console.print(f"[red]demo failed:[/red] {exc}")
        ok = False
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
    console.print("\n[green]demo finished[/green]" if ok else "\n[red]demo: a step misbehaved[/red]")
    return 0 if ok else 1
