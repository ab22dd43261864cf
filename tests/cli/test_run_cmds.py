"""`tether run` as a user runs it: a plan file with no LLM, and a request planned by a real HTTP LLM."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

from bench.kit.fake_llm import FakeLLM
from tests.kits.netutil import CLI, workspace_policy


def _env(tmp_path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_LLM_", "OPENAI_"))}
    return {**env, "TETHER_STATE_DIR": str(tmp_path / "state"), "NO_COLOR": "1", "COLUMNS": "200", **extra}


def test_plan_file_runs_without_an_llm_and_recovers(tmp_path):
    target = tmp_path / "demo" / "sub"
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        f"- skill: shell.run\n  args: {{cmd: mkdir, argv: ['{target}'], cwd: '{tmp_path}'}}\n"
        "  description: make the folder (its parent is missing)\n"
        f"- skill: write_file\n  args: {{file_path: '{target}/hello-world.txt', content: hi}}\n")
    policy = str(workspace_policy(tmp_path))  # the plan's folder, in /tmp: a write root (not the task's own /tmp)
    out = subprocess.run([*CLI, "run", "--policy", policy, "--plan", str(plan)], capture_output=True, text=True,
                         env=_env(tmp_path), timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (target / "hello-world.txt").read_text() == "hi"
    assert "recovery" in out.stdout and "done" in out.stdout

    listed = subprocess.run([*CLI, "tasks", "--json"], capture_output=True, text=True, env=_env(tmp_path), timeout=60)
    [row] = json.loads(listed.stdout)
    assert row["state"] == "done"
    log = subprocess.run([*CLI, "log", row["id"][:10]], capture_output=True, text=True, env=_env(tmp_path),
                         timeout=60)
    assert log.returncode == 0, log.stderr
    assert "step 1 attempt 2" in log.stdout and "AUTO_PATCH" in log.stdout
    full = json.loads(subprocess.run([*CLI, "log", row["id"], "--json"], capture_output=True, text=True,
                                     env=_env(tmp_path), timeout=60).stdout)
    assert [s["result"]["status"] for s in full["steps"]] == ["failure", "success", "success"]
    missing = subprocess.run([*CLI, "log", "nope"], capture_output=True, text=True, env=_env(tmp_path), timeout=60)
    assert missing.returncode == 1 and "no task 'nope'" in missing.stderr


def test_no_llm_says_how_to_configure_one(tmp_path):
    out = subprocess.run([*CLI, "run", "make a folder"], capture_output=True, text=True, env=_env(tmp_path),
                         timeout=60)
    assert out.returncode == 2
    assert "TETHER_LLM_BASE_URL" in out.stderr and "--plan" in out.stderr


async def test_a_request_is_planned_by_the_llm_and_answered(tmp_path):
    folder = tmp_path / "made-by-llm"
    plan = {"steps": [{"skill": "shell.run", "args": {"cmd": "mkdir", "argv": [str(folder)], "cwd": str(tmp_path)},
                       "description": "create the folder"}]}
    async with FakeLLM([json.dumps(plan), "The folder is ready."]) as fake:
        proc = await asyncio.create_subprocess_exec(
            *CLI, "run", "--policy", str(workspace_policy(tmp_path)), f"create a folder made-by-llm in {tmp_path}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
            env=_env(tmp_path, TETHER_LLM_BASE_URL=fake.base_url, TETHER_LLM_MODEL="scripted"))
        stdout, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    text = stdout.decode()
    assert proc.returncode == 0, text
    assert folder.is_dir()
    assert "The folder is ready." in text
    first = fake.requests[0]
    assert "create a folder made-by-llm" in json.dumps(first)
    assert "home " in json.dumps(first) and "may write under" in json.dumps(first)  # this machine's profile

