"""A plan step `on: all` (issue 13): the step runs on every matching device through the fan-out engine.

The whole agent server in-process (task_testkit) with real devices (built-in tools, real shell) over
AIP. The step's result is each device's line plus the summary, and each device's outcome is a
`fanout_device` event of the task as it arrives.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.kits.task import AgentServer
from tether.agent.planning.plan import Plan, PlanStep, validate_plan
from tether.agent.run.steps import fan_out_step
from tether.device.local import build_device
from tether.protocol.models import Command
from tether.tools.policy.model import Policy, default_policy


@pytest.fixture
def shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Policy, Path]:
    """One policy for every device: they may work in one folder, so the same step fits them all."""
    other_temp = tmp_path / "device-temp"
    other_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(other_temp))
    root = tmp_path / "shared"
    root.mkdir()
    return default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]}), root


def echo(root: Path, text: str) -> dict[str, Any]:
    return {"cmd": "echo", "argv": [text], "cwd": str(root)}


async def test_a_step_on_all_runs_on_every_device_and_the_task_goes_on(tmp_path: Path, shared: Any) -> None:
    policy, root = shared
    async with AgentServer(tmp_path) as server:
        for name in ("alpha", "beta", "gamma"):
            await server.add_device(name, policy, tmp_path / f"state-{name}")
        created = await server.create(request="greet the fleet", device="alpha", plan=[
            {"skill": "shell.run", "on": "all", "args": echo(root, "fleet")},
            {"skill": "shell.run", "args": echo(root, "after")}])
        events = await server.events_until(created["id"], lambda e: False)
        task = (await server.api.get(f"/tasks/{created['id']}")).json()
        audit = server.store.audit.rows(limit=20)
    assert task["state"] == "done", task["error"]
    first = task["steps"][0]["result"]
    assert first["status"] == "success"
    data = first["result"]
    assert sorted(d["device"] for d in data["devices"]) == ["alpha", "beta", "gamma"]
    for line in data["devices"]:
        assert line["status"] == "ok" and line["results"][0]["result"]["stdout"] == "fleet\n"
    assert data["summary"]["ok"] == 3 and data["summary"]["total"] == 3
    told = [e for e in events if e["kind"] == "fanout_device"]
    assert sorted(e["data"]["device"] for e in told) == ["alpha", "beta", "gamma"]
    assert all(e["data"]["step"] == 0 and e["data"]["status"] == "ok" for e in told)
    assert task["steps"][1]["result"]["result"]["stdout"] == "after\n"
    fanned = [r for r in audit if r["tool_name"] == "shell.run" and "fleet" in str(r["arguments"])]
    assert sorted(r["device"] for r in fanned) == ["alpha", "beta", "gamma"]
    assert all(r["requested_by"].startswith(f"task:{task['id'][:12]}") for r in fanned)


async def test_an_offline_device_fails_the_step_and_says_which(tmp_path: Path, shared: Any) -> None:
    policy, root = shared
    async with AgentServer(tmp_path) as server:
        for name in ("alpha", "beta"):
            await server.add_device(name, policy, tmp_path / f"state-{name}")
        await server.drop_device("beta")
        created = await server.create(request="greet the fleet", device="alpha", plan=[
            {"skill": "shell.run", "on": "all", "args": echo(root, "fleet")}])
        await server.events_until(created["id"], lambda e: e["kind"] == "question")  # no LLM: a person decides
        task = (await server.api.get(f"/tasks/{created['id']}")).json()
    assert task["state"] == "waiting_for_user"
    step = task["steps"][0]["result"]
    assert step["status"] == "failure"
    assert step["error"].startswith("on: all: 1 of 2 devices succeeded (1 offline); beta: device beta is offline")
    by = {d["device"]: d["status"] for d in step["result"]["devices"]}
    assert by == {"alpha": "ok", "beta": "offline"}


async def test_requires_picks_the_devices_and_none_matching_is_a_clear_failure(tmp_path: Path,
                                                                                shared: Any) -> None:
    policy, root = shared
    async with AgentServer(tmp_path) as server:
        for name in ("alpha", "beta"):
            await server.add_device(name, policy, tmp_path / f"state-{name}")
        one = await server.create(request="only beta", device="alpha", plan=[
            {"skill": "shell.run", "on": "all", "requires": {"name": "beta"}, "args": echo(root, "b")}])
        none = await server.create(request="nobody", device="alpha", plan=[
            {"skill": "shell.run", "on": "all", "requires": {"tags": ["no-such-tag"]}, "args": echo(root, "x")}])
        one_task = await server.finished(one["id"])
        await server.events_until(none["id"], lambda e: e["kind"] == "question")  # no LLM: a person decides
        none_task = (await server.api.get(f"/tasks/{none['id']}")).json()
    assert one_task["state"] == "done", one_task["error"]
    assert [d["device"] for d in one_task["steps"][0]["result"]["result"]["devices"]] == ["beta"]
    assert none_task["state"] == "waiting_for_user"
    assert none_task["steps"][0]["result"]["error"] == \
        'on: all: no device fits {tags: ["no-such-tag"]}: none of the 2 known device(s) fits'


def test_a_plan_may_not_mix_on_all_with_a_device() -> None:
    plan = Plan(steps=[PlanStep(skill="shell.run", on="all", device="alpha"),
                       PlanStep(skill="shell.run", requires={"tags": ["lab"]})])
    problems = validate_plan(plan, {"alpha": [], None: []})
    # without on: all, requires chooses the one device the step runs on (a graph step, issue 31)
    assert problems == ["step 1 (shell.run): on: all runs on every matching device; it does not take device",
                        "step 2 (shell.run): unknown skill 'shell.run' on any device; available skills: none"]


async def test_a_local_task_has_no_fleet_to_fan_out_to(tmp_path: Path, shared: Any) -> None:
    policy, root = shared
    device = build_device(policy=policy, state_dir=tmp_path / "state")
    try:
        command = Command(tool_name="shell.run", parameters=echo(root, "x"))
        result = await fan_out_step(device.dispatcher(session_id="s"), command, None, 5)
    finally:
        await device.aclose()
    assert not result.ok and "this task runs locally" in result.error
