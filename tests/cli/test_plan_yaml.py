"""Plans in YAML as the README writes them (issue 32): `on: all` is the fan-out key, not the boolean
YAML 1.1 would make of it, in a plan file, through `tether run --plan`, and in the dashboard's plan box."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

from tests.kits.fanout import running_app
from tests.kits.task import AgentServer
from tether.agent.planning.plan import load_plan_file
from tether.tools.policy.model import default_policy
from tether.yaml12 import safe_load

CLI = [sys.executable, "-m", "tether.cli"]
README = Path(__file__).resolve().parents[2] / "README.md"


def readme_fanout_step() -> str:
    """The README's own words for a fan-out step: `on: all` and `requires: {tags: [lab]}`."""
    text = README.read_text(encoding="utf-8")
    found = re.search(r"a step with `(on: all)` \(and optionally `(requires: \{tags: \[lab\]\})`\)", text)
    assert found, "the README no longer shows a fan-out step"
    on, requires = found.groups()
    return f"- skill: noop\n  {on}\n  {requires}\n  args: {{n: 1}}\n"


def test_on_off_yes_no_stay_strings_and_true_false_are_booleans() -> None:
    assert safe_load("on: all\noff: 1\nyes: no\ny: n\na: true\nb: False\nc: 1.5\nd: null\n") == {
        "on": "all", "off": 1, "yes": "no", "y": "n", "a": True, "b": False, "c": 1.5, "d": None}


def test_the_readme_step_loads_as_a_fan_out(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(readme_fanout_step())
    [step] = load_plan_file(plan).steps
    assert step.on == "all" and step.requires is not None


async def test_the_readme_plan_runs_with_tether_run_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tether run --plan plan.yaml` on a server's devices, the step written `on: all` as in the README."""
    other_temp = tmp_path / "device-temp"
    other_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(other_temp))
    root = tmp_path / "shared"
    root.mkdir()
    policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
    on_all = readme_fanout_step().splitlines()[1].strip()
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"- skill: shell.run\n  {on_all}\n  args: {{cmd: echo, argv: [fleet], cwd: '{root}'}}\n")
    async with AgentServer(tmp_path) as server:
        for name in ("alpha", "beta"):
            await server.add_device(name, policy, tmp_path / f"state-{name}")
        env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "TETHER_SERVER": f"http://127.0.0.1:{server.port}",
               "TETHER_TOKEN": server.token, "TETHER_STATE_DIR": str(tmp_path / "cli-state")}
        proc = await asyncio.create_subprocess_exec(*CLI, "run", "--device", "alpha", "--plan", str(plan), env=env,
                                                    stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = (b.decode() for b in await asyncio.wait_for(proc.communicate(), 90))
        [task] = (await server.api.get("/tasks")).json()
    assert proc.returncode == 0, (out, err)
    assert "Keys should be strings" not in out + err and "Traceback" not in out + err
    assert task["state"] == "done"


async def test_the_dashboard_reads_on_all_as_the_key_on(tmp_path: Path) -> None:
    async with running_app(tmp_path) as app, app.http(app.reader) as http:
        answer = await http.post("/web/plan", json={"text": readme_fanout_step()})
    assert answer.status_code == 200, answer.text
    [step] = answer.json()["plan"]
    assert step["on"] == "all" and "true" not in step
