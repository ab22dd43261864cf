"""Ask on miss (issue 14, section 4): with `ask: on-miss` a program outside a device's allowlist raises an
approval showing the exact command instead of a flat refusal; approved once it runs once, "always" adds
it to the device's allowlist (a remote policy change), denied it never runs. Through the REST path
(`tether exec --device`) and a task (`tether run --plan`), against real server and device processes."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.kits import db as dbkit
from tests.kits.netutil import CLI, Cluster


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.cluster = Cluster(tmp)
        policy = tmp / "policy.yaml"
        # the commands' cwd (the test's directory, in the temp dir) is a write root of its own: each session's
        # /tmp is private, the machine's directories below it are reached where the policy names them
        policy.write_text(f"ask: on-miss\nwrite_roots: {json.dumps(['~', tempfile.gettempdir(), str(tmp)])}\n")
        self.alpha = self.cluster.device("alpha", extra=("--policy", str(policy)))
        self.cluster.wait_online("alpha", self.alpha)
        self.env = {k: v for k, v in self.cluster.env.items() if not k.startswith(("TETHER_LLM_", "OPENAI_"))}
        self.env.update(TETHER_SERVER=f"http://127.0.0.1:{self.cluster.port}", TETHER_TOKEN=self.cluster.api_token)

    def tether(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, *args], capture_output=True, text=True, env=self.env, timeout=120,
                              stdin=subprocess.DEVNULL)

    def run(self, cmd: str, *argv: str, approve: bool = False) -> subprocess.CompletedProcess[str]:
        return self.tether("exec", "--device", "alpha", "shell.run", f"cmd={cmd}", f"argv={json.dumps(list(argv))}",
                           f"cwd={self.tmp}", "--json", *(["--approve"] if approve else []))

    def plan(self, name: str, cmd: str) -> str:
        path = self.tmp / name
        path.write_text(json.dumps([{"skill": "shell.run", "args": {"cmd": cmd, "argv": [], "cwd": str(self.tmp)}}]))
        return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = Setup(tmp_path_factory.mktemp("ask"))
    yield s
    s.cluster.close()


def _result(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert "Traceback" not in out.stderr, out.stderr
    return json.loads(out.stdout)


def test_a_miss_asks_with_the_exact_command_once_always_and_deny(setup: Setup) -> None:
    asked = _result(setup.run("nproc", "--all"))
    assert asked["status"] == "failure" and asked["result"]["needs_approval"] is True
    assert asked["result"]["rule"] == "ask.on-miss" and "`nproc --all`" in asked["error"]
    once = _result(setup.run("nproc", "--all", approve=True))
    assert once["status"] == "success" and once["result"]["exitCode"] == 0, once
    assert _result(setup.run("nproc"))["result"]["needs_approval"] is True, "once means once"

    always = setup.tether("policy", "allow", "--device", "alpha", "nproc")
    assert always.returncode == 0, always.stdout + always.stderr
    assert _result(setup.run("nproc"))["status"] == "success"

    # what a person could not allow stays refused: no question is raised for it
    sudo = _result(setup.run("sudo", "true"))
    assert sudo["result"].get("denied") is True and sudo["result"]["rule"] == "always-denied"


def test_the_same_approval_path_serves_tasks(setup: Setup) -> None:
    approved = setup.tether("run", "--plan", setup.plan("arch.json", "arch"), "--device", "alpha",
                            "--answer", "approve")
    assert approved.returncode == 0, approved.stdout + approved.stderr
    assert "needs your approval" in approved.stdout and "arch" in approved.stdout
    denied = setup.tether("run", "--plan", setup.plan("arch2.json", "arch"), "--device", "alpha", "--answer", "deny")
    assert denied.returncode != 0, denied.stdout + denied.stderr
    assert "needs your approval" in denied.stdout and "Traceback" not in denied.stderr


def test_ask_always_and_approve_per_program_come_from_the_server(setup: Setup) -> None:
    marked = setup.tether("policy", "approve", "--device", "alpha", "ls")
    assert marked.returncode == 0, marked.stdout + marked.stderr
    held = _result(setup.run("ls"))
    assert held["result"]["needs_approval"] is True and held["result"]["rule"] == "approve"
    assert _result(setup.run("ls", approve=True))["status"] == "success"
    show = json.loads(setup.tether("policy", "show", "--device", "alpha", "--json").stdout)
    assert show["policy"]["commands"]["ls"]["approve"] is True and show["policy"]["commands"]["ls"]["read_only"]

    change = setup.tmp / "always.yaml"
    change.write_text("ask: always\n")
    assert setup.tether("policy", "set", "--device", "alpha", "--file", str(change)).returncode == 0
    echo = _result(setup.run("echo", "hi"))
    assert echo["result"]["rule"] == "ask.always" and "`echo hi`" in echo["error"]
    change.write_text("ask: on-miss\n")
    assert setup.tether("policy", "set", "--device", "alpha", "--file", str(change)).returncode == 0
    assert _result(setup.run("echo", "hi"))["status"] == "success"


def test_always_from_exec_adds_the_program_or_only_its_first_argument(setup: Setup) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return setup.tether("exec", "--device", "alpha", "shell.run", *args, f"cwd={setup.tmp}", "--json")

    pattern = run("cmd=factor", 'argv=["12"]', "--always", "subcommand")
    assert pattern.returncode == 0, pattern.stdout + pattern.stderr
    assert "factor 12 allowed from now on" in pattern.stderr and _result(pattern)["result"]["stdout"] == "12: 2 2 3\n"
    assert _result(run("cmd=factor", 'argv=["12"]'))["status"] == "success"
    other = _result(run("cmd=factor", 'argv=["15"]'))
    assert other["status"] == "failure" and other["result"].get("rule") == "subcommand", other

    program = run("cmd=expr", 'argv=["1", "+", "1"]', "--always", "program")
    assert program.returncode == 0 and _result(program)["result"]["stdout"] == "2\n"
    assert _result(run("cmd=expr", 'argv=["2", "+", "2"]'))["result"]["stdout"] == "4\n"

    for bad, why in ((("cmd=expr", "--always", "forever"), "program or subcommand"),
                     (("cmd=expr", 'argv=["-1"]', "--always", "subcommand"), "first argument"),
                     (("cmd=sudo", 'argv=["x"]', "--always", "program"), "always denied")):
        out = run(*bad)
        assert out.returncode != 0 and why in out.stderr and "Traceback" not in out.stderr, out.stderr
    local = setup.tether("exec", "shell.run", "cmd=expr", "--always", "program")
    assert local.returncode == 2 and "give --device" in local.stderr


def test_always_answers_a_task_approval(setup: Setup) -> None:
    from tether.server.store import Store

    plan = setup.tmp / "getconf.json"
    plan.write_text(json.dumps([{"skill": "shell.run", "args": {"cmd": "getconf", "argv": ["PAGE_SIZE"],
                                                                "cwd": str(setup.tmp)}}]))
    waiting = setup.tether("run", "--plan", str(plan), "--device", "alpha")
    assert waiting.returncode == 3, waiting.stdout + waiting.stderr  # nobody here to answer: it waits
    [task] = [t for t in json.loads(setup.tether("tasks", "--json").stdout) if t["state"] == "waiting_for_user"]

    store = Store(dbkit.server_db(setup.cluster.db))
    _, approver = store.tokens.create("api", "approver", ["read", "execute", "approve"])
    store.close()
    env_token = setup.env["TETHER_TOKEN"]
    setup.env["TETHER_TOKEN"] = approver
    try:
        refused = setup.tether("approve", task["id"], "--always", "program")
        assert refused.returncode != 0 and "admin" in refused.stderr and "Traceback" not in refused.stderr
    finally:
        setup.env["TETHER_TOKEN"] = env_token
    bad = setup.tether("approve", task["id"], "--always", "forever")
    assert bad.returncode == 2 and "program or subcommand" in bad.stderr

    done = setup.tether("approve", task["id"], "--always", "program")
    assert done.returncode == 0, done.stdout + done.stderr
    from tests.kits.netutil import wait_for

    ended = wait_for(lambda: (t := setup.cluster.remote.task(task["id"], events=False))["state"] in
                     ("done", "failed", "cancelled") and t, "the task to end", 60)
    assert ended["state"] == "done", ended
    # from now on the program needs no approval on that device, and the change is in its policy
    assert _result(setup.run("getconf", "PAGE_SIZE"))["status"] == "success"
    shown = json.loads(setup.tether("policy", "show", "--device", "alpha", "--json").stdout)
    assert "getconf" in shown["policy"]["commands"]
