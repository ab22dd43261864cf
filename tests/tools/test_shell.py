"""The shell tools against real processes, called through the runtime (validation, timeouts, results)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tether.protocol.models import Result, ResultStatus
from tether.tools.context import ToolContext
from tether.tools.policy.model import CommandRule, Policy, default_policy
from tether.tools.running import process
from tether.tools.running.process import run_process
from tether.tools.shell.tool import shell_toolset

GRANDCHILD = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(1)
"""

TREE = """
import os, pathlib, signal, subprocess, sys, time
d = pathlib.Path(sys.argv[1])
(d / "child.pid").write_text(str(os.getpid()))
quiet = "--background" in sys.argv  # a straggler that lets go of our pipes
subprocess.Popen([sys.executable, str(d / "grandchild.py"), str(d / "grandchild.pid")],
                 stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.DEVNULL if quiet else None)
while not (d / "grandchild.pid").exists():
    time.sleep(0.01)
print("ready", flush=True)
if quiet:
    sys.exit(0)
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while True:
    time.sleep(1)
"""


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    roots = ["~", str(tmp_path)]
    return default_policy().model_copy(update={"read_roots": roots, "write_roots": roots})


def make_ctx(policy: Policy, events: list[tuple[str, dict[str, Any]]] | None = None, **kw: Any) -> ToolContext:
    if events is not None:
        kw["emit"] = lambda kind, data: events.append((kind, data))
    return ToolContext(policy=policy, call_id="call-1", **kw)


async def call(policy: Policy, name: str, args: dict[str, Any], *, timeout: float | None = None,
               **ctx: Any) -> Result:
    return await shell_toolset().call(name, args, make_ctx(policy, **ctx), timeout=timeout)


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def tree(tmp_path: Path) -> str:
    script(tmp_path, "grandchild.py", GRANDCHILD)
    return script(tmp_path, "tree.py", TREE)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # a killed orphan may wait for a reaper
    except psutil.NoSuchProcess:
        return False


async def still_alive(pids: list[int], within: float = 5.0) -> list[int]:
    """The pids still running after up to `within` seconds, polling and yielding (never a fixed sleep)."""
    deadline = time.monotonic() + within
    while (running := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return running


def tree_pids(tmp_path: Path) -> list[int]:
    files = [tmp_path / "child.pid", tmp_path / "grandchild.pid"]
    missing = [f.name for f in files if not f.exists()]
    assert not missing, f"the process tree never started ({missing} missing): is this machine badly overloaded?"
    return [int(f.read_text()) for f in files]


async def test_run_returns_output_and_exit_code(tmp_path: Path, policy: Policy) -> None:
    prog = script(tmp_path, "hello.py", "import sys\nprint('out')\nprint('err', file=sys.stderr)\n")
    result = await call(policy, "shell.run", {"cmd": "python3", "argv": [prog], "cwd": str(tmp_path)})
    assert result.status is ResultStatus.SUCCESS, result.error
    body = result.result
    assert (body["ok"], body["stdout"], body["stderr"], body["exitCode"]) == (True, "out\n", "err\n", 0)
    assert body["executionTime"] > 0 and isinstance(body["pid"], int)
    assert body["truncated"] == {"stdout": False, "stderr": False}


async def test_absolute_program_path(tmp_path: Path, policy: Policy) -> None:
    echo = shutil.which("echo")
    assert echo and not echo.startswith(str(tmp_path))
    result = await call(policy, "shell.run", {"cmd": echo, "argv": ["hi"], "cwd": str(tmp_path)})
    assert result.ok and result.result["stdout"] == "hi\n"


async def test_nonzero_exit_fails_with_the_payload(tmp_path: Path, policy: Policy) -> None:
    prog = script(tmp_path, "fail.py", "import sys\nprint('partial')\nsys.stderr.write('first\\nboom\\n')\n"
                                       "sys.exit(3)\n")
    result = await call(policy, "shell.run", {"cmd": "python3", "argv": [prog], "cwd": str(tmp_path)})
    assert result.status is ResultStatus.FAILURE
    assert result.error == "shell.run: exit code 3: boom"
    assert result.result["exitCode"] == 3 and result.result["stdout"] == "partial\n" and not result.result["ok"]


@pytest.mark.parametrize(("where", "rule"), [
    (None, "cwd.required"), ("/etc", "read_roots"), ("file", "cwd.exists"), ("link", "read_roots"),
    ("dotdot", "read_roots"), ("relative", "read_roots"),
])
async def test_cwd_must_be_an_allowed_directory(tmp_path: Path, policy: Policy, where: str | None, rule: str) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to("/etc")
    cwd = {None: None, "/etc": "/etc", "file": str(tmp_path / "file"), "link": str(tmp_path / "link"),
           "dotdot": str(tmp_path / ".." / ".."), "relative": "some/dir"}[where]
    result = await call(policy, "shell.run", {"cmd": "ls", "cwd": cwd})
    assert result.status is ResultStatus.FAILURE
    assert result.result == {"denied": True, "rule": rule}, result.error
    assert f"'{rule}'" in result.error


@pytest.mark.parametrize(("cmd", "argv", "rule"), [
    ("sudo", ["id"], "always-denied"), ("python3", ["-c", "print(1)"], "inline-code"),
    ("find", [".", "-exec", "rm", "{}", ";"], "escape.find-exec"), ("nice", ["ls"], "escape.wrapper"),
    ("curl", ["http://example.com"], "not-allowed"), ("./ls", [], "cmd.invalid"),
])
async def test_policy_denials_name_the_rule(tmp_path: Path, policy: Policy, cmd: str, argv: list[str],
                                            rule: str) -> None:
    result = await call(policy, "shell.run", {"cmd": cmd, "argv": argv, "cwd": str(tmp_path)})
    assert result.result == {"denied": True, "rule": rule}, result.error


async def test_dry_run_executes_nothing(tmp_path: Path, policy: Policy) -> None:
    result = await call(policy, "shell.run", {"cmd": "touch", "argv": ["newfile"], "cwd": str(tmp_path),
                                              "dryRun": True})
    assert result.ok, result.error
    assert result.result["dryRun"] and result.result["allowed"]
    assert result.result["preview"] == "touch newfile" and result.result["cwd"] == str(tmp_path)
    assert not (tmp_path / "newfile").exists()
    denied = await call(policy, "shell.run", {"cmd": "python3", "argv": ["-c", "1"], "cwd": str(tmp_path),
                                              "dryRun": True})
    assert denied.result == {"denied": True, "rule": "inline-code"}


async def test_timeout_ms_kills_the_process_tree(tmp_path: Path, policy: Policy,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "KILL_GRACE_S", 0.3)  # the grandchild ignores SIGTERM: it waits out the grace
    result = await call(policy, "shell.run", {"cmd": "python3", "argv": [tree(tmp_path), str(tmp_path)],
                                              "cwd": str(tmp_path), "timeoutMs": 2000})
    assert result.status is ResultStatus.FAILURE and "timed out after 2s" in result.error
    assert result.result["timedOut"] and result.result["stdout"] == "ready\n"  # partial output is kept
    assert await still_alive(tree_pids(tmp_path)) == []


async def test_runtime_timeout_kills_the_process_tree(tmp_path: Path, policy: Policy,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "KILL_GRACE_S", 0.3)
    result = await call(policy, "shell.run", {"cmd": "python3", "argv": [tree(tmp_path), str(tmp_path)],
                                              "cwd": str(tmp_path)}, timeout=1.0)
    assert result.status is ResultStatus.FAILURE and "timed out after 1s" in result.error
    assert await still_alive(tree_pids(tmp_path)) == []


async def test_cancel_kills_the_group_even_when_sigterm_is_ignored(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "KILL_GRACE_S", 0.2)
    ready = asyncio.Event()
    task = asyncio.create_task(run_process(
        [sys.executable, tree(tmp_path), str(tmp_path), "--ignore-term"], cwd=str(tmp_path), env=None, stdin=None,
        max_output=1000, on_output=lambda stream, chunk: ready.set() if b"ready" in chunk else None))
    await asyncio.wait_for(ready.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await still_alive(tree_pids(tmp_path)) == []


async def test_background_stragglers_do_not_outlive_the_command(tmp_path: Path) -> None:
    result = await run_process([sys.executable, tree(tmp_path), str(tmp_path), "--background"], cwd=str(tmp_path),
                               env=None, stdin=None, max_output=1000)
    assert result.exit_code == 0 and result.stdout == b"ready\n"
    assert await still_alive(tree_pids(tmp_path)[1:]) == []


async def test_output_cap_sets_the_truncated_flag(tmp_path: Path, policy: Policy) -> None:
    capped = policy.model_copy(update={"max_output_bytes": 1000})
    prog = script(tmp_path, "loud.py", "import sys\nsys.stdout.write('x' * 200_000)\nsys.stderr.write('e' * 10)\n")
    result = await call(capped, "shell.run", {"cmd": "python3", "argv": [prog], "cwd": str(tmp_path)})
    assert result.ok, result.error  # the child was never blocked on a full pipe
    assert result.result["truncated"] == {"stdout": True, "stderr": False}
    assert result.result["stdout"] == "x" * 1000 and result.result["stderr"] == "e" * 10


async def test_output_is_streamed_as_events(tmp_path: Path, policy: Policy) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    prog = script(tmp_path, "talk.py", "import sys\nfor i in range(3):\n    print(f'line {i} héllo', flush=True)\n"
                                       "print('warn', file=sys.stderr)\n")
    result = await call(policy, "shell.run", {"cmd": "python3", "argv": [prog], "cwd": str(tmp_path)},
                        events=events)
    assert result.ok, result.error
    assert events and all(kind == "output" and data["call_id"] == "call-1" for kind, data in events)
    streamed = {name: "".join(d["data"] for _, d in events if d["stream"] == name) for name in ("stdout", "stderr")}
    assert streamed == {"stdout": result.result["stdout"], "stderr": "warn\n"}
    assert "line 2 héllo" in streamed["stdout"]


async def test_stdin_and_undecodable_output(tmp_path: Path, policy: Policy) -> None:
    result = await call(policy, "shell.run", {"cmd": "cat", "cwd": str(tmp_path), "stdin": "hello\nworld"})
    assert result.result["stdout"] == "hello\nworld"
    prog = script(tmp_path, "bytes.py", "import sys\nsys.stdout.buffer.write(b'\\xff ok')\n")
    result = await call(policy, "shell.run", {"cmd": "python3", "argv": [prog], "cwd": str(tmp_path)})
    assert result.result["stdout"] == "\ufffd ok"


async def test_environment_is_minimal_plus_what_was_given(tmp_path: Path, policy: Policy,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_TEST_SECRET", "s3cret")
    prog = script(tmp_path, "env.py", "import json, os\nprint(json.dumps(dict(os.environ)))\n")
    result = await call(policy, "shell.run", {"cmd": "python3", "argv": [prog], "cwd": str(tmp_path),
                                              "env": {"GREETING": "hi"}})
    env = json.loads(result.result["stdout"])
    assert env["GREETING"] == "hi" and env["PAGER"] == "cat" and "TETHER_TEST_SECRET" not in env
    denied = await call(policy, "shell.run", {"cmd": "ls", "cwd": str(tmp_path), "env": {"LD_PRELOAD": "/x.so"}})
    assert denied.result == {"denied": True, "rule": "escape.env"}


async def test_command_not_found(tmp_path: Path, policy: Policy) -> None:
    missing = policy.model_copy(update={"commands": {**policy.commands, "tether-no-such-program": CommandRule()}})
    result = await call(missing, "shell.run", {"cmd": "tether-no-such-program", "cwd": str(tmp_path)})
    assert result.error == "shell.run: command not found: tether-no-such-program (not on PATH)"


async def test_program_planted_in_a_writable_root_is_refused(tmp_path: Path, policy: Policy) -> None:
    planted = tmp_path / "ls"
    planted.symlink_to(shutil.which("sh") or "/bin/sh")  # judged as `ls`, but it is a shell
    result = await call(policy, "shell.run", {"cmd": str(planted), "argv": ["-c", "echo pwned"],
                                              "cwd": str(tmp_path)})
    assert result.result == {"denied": True, "rule": "escape.writable-executable"}, result.error


async def test_deleting_outside_the_temp_dir_needs_approval(tmp_path: Path, policy: Policy) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "tmp.txt").write_text("x")
    keep = tmp_path / "keep.txt"
    keep.write_text("x")
    args = {"cmd": "rm", "argv": ["keep.txt"], "cwd": str(tmp_path)}
    result = await call(policy, "shell.run", args, temp_dir=str(scratch))
    assert result.result == {"needs_approval": True, "rule": "approval.delete"} and keep.exists()
    dry = await call(policy, "shell.run", {**args, "dryRun": True}, temp_dir=str(scratch))
    assert dry.result["needsApproval"] == "approval.delete"
    assert (await call(policy, "shell.run", args, temp_dir=str(scratch), approved_by="alice")).ok
    assert not keep.exists()
    inside = await call(policy, "shell.run", {"cmd": "rm", "argv": ["tmp.txt"], "cwd": str(scratch)},
                        temp_dir=str(scratch))
    assert inside.ok and not (scratch / "tmp.txt").exists()


@pytest.mark.parametrize(("command", "advice"), [
    ("ls | wc -l", "pipes are not supported: run each command separately with shell.run and pass data through stdin"),
    ("ls; rm x", "command lists"), ("ls && ls", "command lists"), ("ls || ls", "command lists"),
    ("ls\nrm x", "command lists"), ("echo hi > f", "redirections"), ("cat < f", "redirections"),
    ("ls 2> err", "redirections"), ("ls &> all", "redirections"), ("sleep 1 &", "background jobs"),
    ("echo $(id)", "command substitution"), ("echo `id`", "command substitution"),
    ('echo "$(id)"', "command substitution"), ("echo $HOME", "variables"), ('echo "${HOME}"', "variables"),
    ("(ls)", "subshells"), ("ls # comment", "comments"), ("echo 'unclosed", "cannot split"), ("   ", "empty"),
])
async def test_shell_execute_refuses_shell_syntax_with_advice(policy: Policy, command: str, advice: str) -> None:
    result = await call(policy, "shell_execute", {"command": command})
    assert result.status is ResultStatus.FAILURE and advice in result.error, result.error


async def test_shell_execute_splits_quoted_words(tmp_path: Path, policy: Policy) -> None:
    prog = script(tmp_path, "argv.py", "import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    command = f"""python3 {prog} 'a b' "c d" e\\ f '' 'x|y' "it's" '$(not run)'"""
    result = await call(policy.model_copy(update={"allow_escapes": ["substitution"]}), "shell_execute",
                        {"command": command})
    assert result.ok, result.error
    assert json.loads(result.result["stdout"]) == ["a b", "c d", "e f", "", "x|y", "it's", "$(not run)"]
    assert result.result["exit_code"] == 0 and result.result["execution_time"] > 0
    denied = await call(policy, "shell_execute", {"command": f"python3 {prog} '$(id)'"})
    assert denied.result == {"denied": True, "rule": "escape.substitution"}


async def test_shell_execute_timeout(policy: Policy) -> None:
    result = await call(policy, "shell_execute", {"command": "sleep 30", "timeout": 0.3})
    assert result.status is ResultStatus.FAILURE and "timed out after 0.3s" in result.error


@pytest.mark.parametrize("command", ["rm -rf x", "git push", "git branch -D main", "sed -i s/a/b/ f",
                                     "sort -o out f", "tee f", "touch f", "python3 s.py"])
async def test_shell_execute_read_refuses_writes(policy: Policy, command: str) -> None:
    result = await call(policy, "shell_execute_read", {"command": command})
    assert result.result == {"denied": True, "rule": "read-only"}, result.error


async def test_shell_execute_read_runs_read_only_commands(tmp_path: Path, policy: Policy) -> None:
    (tmp_path / "visible.txt").write_text("x")
    result = await call(policy, "shell_execute_read", {"command": f"ls {tmp_path}"})
    assert result.ok and result.result["stdout"] == "visible.txt\n"
    assert (await call(policy, "shell_execute", {"command": f"touch {tmp_path / 'made'}"})).ok
    assert (tmp_path / "made").exists()


@pytest.mark.parametrize(("args", "error"), [
    ({"cmd": "ls", "argv": "-la", "cwd": "/tmp"}, "argument 'argv'"),
    ({"cmd": "ls", "cwd": "/tmp", "timeoutMs": 0}, "argument 'timeoutMs'"),
    ({"cmd": "ls", "cwd": "/tmp", "shell": True}, "unknown argument 'shell'"),
    ({"argv": ["x"], "cwd": "/tmp"}, "missing required argument 'cmd'"),
])
async def test_bad_arguments_are_clear_failures(policy: Policy, args: dict[str, Any], error: str) -> None:
    result = await call(policy, "shell.run", args)
    assert result.status is ResultStatus.FAILURE and error in result.error, result.error


def test_toolset() -> None:
    infos = {i.name: i for i in shell_toolset().infos()}
    assert {name: i.tool_type for name, i in infos.items()} == {
        "shell.run": "action", "shell_execute": "action", "shell_execute_read": "data_collection"}
    assert infos["shell.run"].input_schema["required"] == ["cmd"]
    assert all(i.namespace == "shell" and i.description for i in infos.values())
    assert os.environ.get("PATH")  # the tools resolve programs on the device's PATH
