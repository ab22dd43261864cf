"""One config file with sections (`llm:`, `device:`, `server:`, `policy:`, `mcp:`, `mcpServers:`), one
flag (`--config`, or $TETHER_CONFIG), read the same by every command; a file named on purpose that
does not exist is an error, never silently ignored. Real CLI processes."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench.kit.fake_llm import FakeLLM
from tests.kits.netutil import CLI, tether_env

TIME_SERVER = {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}


def tether(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in tether_env(tmp_path / "state").items() if not k.startswith(("TETHER_LLM_", "OPENAI_"))}
    base.pop("TETHER_CONFIG", None)
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**base, "XDG_CONFIG_HOME": str(tmp_path / "xdg"), **env})


@pytest.mark.parametrize("command", [["tools"], ["run", "--plan", "plan.json"], ["exec", "get_system_info"]])
def test_tether_config_naming_a_missing_file_is_an_error(tmp_path, command):
    (tmp_path / "plan.json").write_text(json.dumps([{"skill": "get_system_info", "args": {}}]))
    args = [a if a != "plan.json" else str(tmp_path / a) for a in command]
    done = tether(tmp_path, *args, TETHER_CONFIG=str(tmp_path / "nope.yaml"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "TETHER_CONFIG names" in done.stderr and "nope.yaml" in done.stderr and "Traceback" not in done.stderr


def test_one_file_with_sections_is_read_by_every_command(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "device: {name: laptop, tags: [lab]}\n"
        f"policy: {{write_roots: ['{tmp_path / 'only'}']}}\n"  # writes only under only/
        f"mcpServers: {{time: {json.dumps(TIME_SERVER)}}}\n")
    listed = tether(tmp_path, "tools", "--json", "--config", str(config))
    assert listed.returncode == 0, listed.stderr
    names = {t["name"] for t in json.loads(listed.stdout)}
    assert "get_current_time" in names  # from the file's mcpServers
    # the file's policy applies: a write inside its write root goes ahead, one outside is refused
    (tmp_path / "only").mkdir()
    ok = tether(tmp_path, "exec", "--config", str(config), "--json", "write_file",
                f"file_path={tmp_path / 'only' / 'a.txt'}", "content=x")
    assert json.loads(ok.stdout)["status"] == "success", ok.stdout + ok.stderr
    refused = tether(tmp_path, "exec", "--config", str(config), "--json", "write_file",
                     f"file_path={tmp_path / 'b.txt'}", "content=x")
    assert json.loads(refused.stdout)["status"] == "failure" and not (tmp_path / "b.txt").exists()
    # the same file through $TETHER_CONFIG, and as the default file
    via_env = tether(tmp_path, "tools", "--json", TETHER_CONFIG=str(config))
    assert "get_current_time" in {t["name"] for t in json.loads(via_env.stdout)}, via_env.stderr
    (tmp_path / "xdg" / "tether").mkdir(parents=True)
    (tmp_path / "xdg" / "tether" / "config.yaml").write_text(config.read_text())
    default = tether(tmp_path, "tools", "--json")
    assert "get_current_time" in {t["name"] for t in json.loads(default.stdout)}, default.stderr


def test_unknown_sections_and_a_policy_given_twice_are_errors(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("llm: {base_url: 'http://127.0.0.1:1/v1', model: m}\nplugins: {}\n")
    done = tether(tmp_path, "tools", "--config", str(config))
    assert done.returncode == 2 and "unknown section(s) plugins" in done.stderr and "llm" in done.stderr
    config.write_text("policy: {commands: {echo: {}}}\ndevice: {policy: {commands: {}}}\n")
    done = tether(tmp_path, "tools", "--config", str(config))
    assert done.returncode == 2 and "the policy is given twice" in done.stderr


async def test_run_config_with_an_llm_section_plans_with_it(tmp_path):
    plan = [{"skill": "shell.run", "args": {"cmd": "echo", "argv": ["planned"], "cwd": str(tmp_path)}}]
    async with FakeLLM([json.dumps({"steps": plan}), "It said planned."]) as fake:
        config = tmp_path / "config.yaml"
        config.write_text(f"llm: {{base_url: '{fake.base_url}', model: scripted}}\n"  # the step's cwd, in /tmp:
                          f"policy: {{write_roots: ['~', '{tempfile.gettempdir()}', '{tmp_path}']}}\n")  # a root
        import asyncio

        done = await asyncio.to_thread(tether, tmp_path, "run", "--config", str(config), "say planned")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "planned" in done.stdout and "no LLM is configured" not in done.stderr


def test_old_forms_still_load(tmp_path):
    desktop = tmp_path / "claude_desktop_config.json"  # a desktop client's file, its own keys ignored
    desktop.write_text(json.dumps({"globalShortcut": "Ctrl+Space", "mcpServers": {"time": TIME_SERVER}}))
    listed = tether(tmp_path, "tools", "--json", "--config", str(desktop))
    assert listed.returncode == 0 and "get_current_time" in listed.stdout, listed.stderr
    policy = tmp_path / "policy.yaml"  # a plain policy file given to --policy
    policy.write_text(f"commands: {{echo: {{}}}}\nwrite_roots: ['~', '{tempfile.gettempdir()}', '{tmp_path}']\n")
    ok = tether(tmp_path, "exec", "--policy", str(policy), "--json", "shell.run", "cmd=echo", 'argv=["x"]',
                f"cwd={tmp_path}")
    assert json.loads(ok.stdout)["status"] == "success", ok.stderr
