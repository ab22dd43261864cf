"""Confirmation and dry runs: a plan is shown and waits for "run" before any step runs (every part of it:
the first plan and what is planned after an observation); `tether run --dry-run` plans or checks and runs
nothing. Real local device and files, the scripted LLM server, the real CLI in a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
from pathlib import Path

from bench.kit.fake_llm import FakeLLM
from tests.agent.test_executor import Asker, device, make_runner, plan_of, reply, work, write  # noqa: F401  (fixtures)
from tests.kits.netutil import CLI
from tether.agent.llm.chat import LLMClient
from tether.agent.run.confirm import confirmation_answer
from tether.agent.run.task import Task, TaskState
from tether.device.local import LocalDevice


async def test_always_shows_the_plan_and_runs_on_run(device: LocalDevice, work: Path) -> None:  # noqa: F811
    ask = Asker("what is this?", "run")
    runner = await make_runner(device, None, ask)
    task = await runner.run(Task(request="write", plan=plan_of(write(work / "a.txt", "A")), confirm="always"))
    assert task.state is TaskState.DONE, task.error
    assert (work / "a.txt").read_text() == "A"
    assert len(ask.questions) == 2  # free words are neither run nor cancel: asked again
    shown = ask.questions[0].question
    assert shown.startswith("Run this plan?\n1. write_file ") and str(work / "a.txt") in shown
    assert ask.questions[0].options == ["run", "cancel"]
    [question] = task.questions
    assert question.kind == "confirmation" and question.answer == "run"
    states = [e.data["to"] for e in task.events if e.kind == "state"]
    assert states == ["waiting_for_user", "running", "done"]


async def test_cancel_runs_nothing(device: LocalDevice, work: Path) -> None:  # noqa: F811
    runner = await make_runner(device, None, Asker("cancel"))
    task = await runner.run(Task(request="write", plan=plan_of(write(work / "a.txt", "A")), confirm="always"))
    assert task.state is TaskState.CANCELLED and task.error == "the plan was not confirmed"
    assert not (work / "a.txt").exists() and not task.steps


async def test_destructive_asks_only_for_plans_that_change_things(device: LocalDevice, work: Path) -> None:  # noqa: F811
    reader = await make_runner(device, None, Asker())  # asks nothing: a question would fail the test
    looked = await reader.run(Task(request="look", plan=plan_of({"skill": "list_dir", "args": {"path": str(work)}}),
                                   confirm="destructive"))
    assert looked.state is TaskState.DONE and not looked.questions
    ask = Asker("no")
    writer = await make_runner(device, None, ask)
    task = await writer.run(Task(request="w", plan=plan_of({"skill": "list_dir", "args": {"path": str(work)}},
                                                          write(work / "b.txt", "B")), confirm="destructive"))
    assert task.state is TaskState.CANCELLED and len(ask.questions) == 1 and not (work / "b.txt").exists()


async def test_each_part_after_an_observation_is_confirmed(device: LocalDevice, work: Path) -> None:  # noqa: F811
    first = {"steps": [{"skill": "list_dir", "args": {"path": str(work)}}, {"skill": "observe"}]}
    second = {"steps": [write(work / "seen.txt", "seen")]}
    async with FakeLLM([reply(first), reply(second), "Done."]) as fake, LLMClient(fake.settings()) as llm:
        ask = Asker("run", "run")
        runner = await make_runner(device, llm, ask)
        task = await runner.run(Task(request="look, then write", confirm="always"))
    assert task.state is TaskState.DONE, task.error
    assert (work / "seen.txt").read_text() == "seen"
    assert ask.questions[0].question.startswith("Run this plan?\n1. list_dir")
    assert ask.questions[1].question.startswith("Run this plan?\n2. write_file")  # numbering goes on


def test_answer_words() -> None:
    assert [confirmation_answer(a) for a in ("run", " Yes ", "1", "approve", "cancel", "n", "2", "", "maybe")] == [
        True, True, True, True, False, False, False, None, None]


# -- the CLI ----------------------------------------------------------------------------------------------


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_LLM_", "OPENAI_", "TETHER_SERVER"))}
    return {**env, "TETHER_STATE_DIR": str(tmp_path / "state"), "NO_COLOR": "1", "COLUMNS": "200", **extra}


def _cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=_env(tmp_path, **env), timeout=120,
                          stdin=subprocess.DEVNULL)


def _plan_file(tmp_path: Path, target: Path) -> Path:
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"- skill: write_file\n  args: {{file_path: '{target}', content: hi}}\n  description: say hi\n")
    return plan


def test_dry_run_of_a_plan_file_shows_it_and_runs_nothing(tmp_path: Path) -> None:
    target = tmp_path / "hi.txt"
    out = _cli(tmp_path, "run", "--dry-run", "--plan", str(_plan_file(tmp_path, target)))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "plan (dry run, nothing ran):" in out.stdout and f"1. write_file {{\"file_path\": \"{target}\"" in out.stdout
    assert "say hi" in out.stdout and "Traceback" not in out.stderr
    assert not target.exists()
    listed = _cli(tmp_path, "tasks", "--json")
    assert json.loads(listed.stdout) == []  # nothing stored either


def test_dry_run_of_a_bad_plan_lists_its_problems(tmp_path: Path) -> None:
    plan = tmp_path / "bad.yaml"
    plan.write_text("- skill: no.such.tool\n  args: {}\n- skill: write_file\n"
                    "  args: {file_path: /tmp/x, content: {$ref: steps.5.result}}\n")
    out = _cli(tmp_path, "run", "--dry-run", "--plan", str(plan))
    assert out.returncode == 1
    assert "error: the plan has problems:" in out.stderr and "unknown skill 'no.such.tool'" in out.stderr
    assert "names step 5, but a step can only use steps before it" in out.stderr and "Traceback" not in out.stderr


async def test_dry_run_of_a_request_plans_with_the_llm_and_runs_nothing(tmp_path: Path) -> None:
    target = tmp_path / "planned.txt"
    plan = {"steps": [{"skill": "write_file", "args": {"file_path": str(target), "content": "x"}}]}
    async with FakeLLM([reply(plan)]) as fake:
        proc = await asyncio.create_subprocess_exec(
            *CLI, "run", "--dry-run", "write planned.txt", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
            env=_env(tmp_path, TETHER_LLM_BASE_URL=fake.base_url, TETHER_LLM_MODEL="scripted"))
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, stdout.decode() + stderr.decode()
    assert "1. write_file" in stdout.decode() and not target.exists()
    assert len(fake.requests) == 1  # the plan only: no answer was written, nothing ran


def test_confirm_without_a_terminal_runs_nothing_and_with_an_answer_runs(tmp_path: Path) -> None:
    target = tmp_path / "hi.txt"  # in the machine's temp dir: a write root the policy names (the rest of /tmp is
    policy = tmp_path / "policy.json"  # the task's private /tmp, gone when it ends)
    policy.write_text(json.dumps({"write_roots": ["~", tempfile.gettempdir(), str(tmp_path)]}))
    plan = str(_plan_file(tmp_path, target))
    refused = _cli(tmp_path, "run", "--policy", str(policy), "--confirm", "--plan", plan)
    assert refused.returncode == 1 and not target.exists()
    assert "Run this plan?" in refused.stdout and "Traceback" not in refused.stderr
    ran = _cli(tmp_path, "run", "--policy", str(policy), "--confirm", "--answer", "run", "--plan", plan)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert target.read_text() == "hi"


def test_remote_dry_run_to_an_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    out = _cli(tmp_path, "run", "--dry-run", "--server", "http://127.0.0.1:9", "--token", "tapi_x", "x")
    assert out.returncode != 0 and "cannot reach the tether server" in out.stderr and "Traceback" not in out.stderr


# -- a server: tasks created by a token whose plans must be confirmed ----------------------------------------


async def test_a_token_with_confirm_destructive_holds_plans_that_change_things(tmp_path: Path) -> None:
    from tests.kits.task import AgentServer
    from tether.tools.policy.model import default_policy

    root = tmp_path / "alpha"
    root.mkdir()
    policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        info, secret = server.store.tokens.create("api", "careful", ["read", "execute", "approve"],
                                                 confirm="destructive")
        assert info.confirm == "destructive"
        assert [t.confirm for t in server.store.tokens.all() if t.name == "careful"] == ["destructive"]
        careful = {"Authorization": f"Bearer {secret}"}
        looking = (await server.api.post("/tasks", json={"device": "alpha", "plan": [
            {"skill": "list_dir", "args": {"path": str(root)}}]}, headers=careful)).json()
        assert (await server.finished(looking["id"]))["state"] == "done"  # read-only: not held
        results = {}
        for approved in (False, True):
            target = root / f"{approved}.txt"
            created = (await server.api.post("/tasks", json={"device": "alpha", "plan": [
                {"skill": "write_file", "args": {"file_path": str(target), "content": "x"}}]},
                headers=careful)).json()
            events = await server.events_until(created["id"], lambda e: e["kind"] == "question")
            asked = events[-1]["data"]
            assert asked["kind"] == "confirmation" and asked["question"].startswith("Run this plan?\n1. write_file")
            waiting = (await server.api.get(f"/tasks/{created['id']}")).json()
            assert waiting["state"] == "waiting_for_user" and not waiting["steps"] and not target.exists()
            response = await server.api.post(f"/tasks/{created['id']}/approval", json={"approved": approved},
                                             headers=careful)
            assert response.status_code == 200, response.text
            results[approved] = (await server.finished(created["id"]), target)
        # the default token (confirm never) is not held
        plain = await server.create(request="w", device="alpha", plan=[
            {"skill": "write_file", "args": {"file_path": str(root / "plain.txt"), "content": "p"}}])
        assert (await server.finished(plain["id"]))["state"] == "done"
    denied, denied_file = results[False]
    assert denied["state"] == "cancelled" and denied["error"] == "the plan was not confirmed"
    assert not denied_file.exists()
    ran, ran_file = results[True]
    assert ran["state"] == "done" and ran_file.read_text() == "x"
    assert ran["questions"][0]["answered_by"] == "api:careful"


def test_token_create_confirm_is_checked(tmp_path: Path) -> None:
    db = str(tmp_path / "server.db")
    bad = _cli(tmp_path, "token", "create", "--api", "x", "--confirm", "sometimes", "--db", db)
    assert bad.returncode != 0 and "confirm must be never, destructive or always" in bad.stderr
    assert "Traceback" not in bad.stderr
    for_device = _cli(tmp_path, "token", "create", "--device", "d", "--confirm", "always", "--db", db)
    assert for_device.returncode != 0 and "confirm is for API tokens" in for_device.stderr
    good = _cli(tmp_path, "token", "create", "--api", "x", "--confirm", "always", "--db", db, "--json")
    assert good.returncode == 0 and json.loads(good.stdout)["confirm"] == "always"
    listed = _cli(tmp_path, "token", "list", "--json", "--db", db)
    assert [t["confirm"] for t in json.loads(listed.stdout)] == ["always"]


def test_run_confirm_through_a_server(tmp_path: Path) -> None:
    """`tether run --confirm` on a server's device: the task waits with its plan (no terminal: exit 3, left
    waiting for `tether approve`); with `--answer run` it runs."""
    import re

    from tests.kits.netutil import Cluster

    root = tmp_path / "root"
    root.mkdir()
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"read_roots: [{json.dumps(str(root))}]\nwrite_roots: [{json.dumps(str(root))}]\n")
    (tmp_path / "cluster").mkdir()
    cluster = Cluster(tmp_path / "cluster")
    try:
        alpha = cluster.device("alpha", extra=("--policy", str(policy)))
        cluster.wait_online("alpha", alpha)
        env = {k: v for k, v in cluster.env.items() if not k.startswith(("TETHER_LLM_", "OPENAI_"))}
        env.update(TETHER_SERVER=f"http://127.0.0.1:{cluster.port}", TETHER_TOKEN=cluster.api_token, NO_COLOR="1")

        def tether(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=120,
                                  stdin=subprocess.DEVNULL)

        held, ran = root / "held.txt", root / "ran.txt"
        for target in (held, ran):
            (tmp_path / f"{target.stem}.json").write_text(json.dumps(
                [{"skill": "write_file", "args": {"file_path": str(target), "content": "x"}}]))
        waiting = tether("run", "--confirm", "--device", "alpha", "--plan", str(tmp_path / "held.json"))
        assert waiting.returncode == 3, waiting.stdout + waiting.stderr
        assert "Run this plan?" in waiting.stdout and not held.exists()
        task = re.search(r"^task ([0-9a-f]{32}) on ", waiting.stdout, re.M)
        assert task, waiting.stdout
        approved = tether("approve", task.group(1))
        assert approved.returncode == 0, approved.stdout + approved.stderr
        followed = tether("log", task.group(1), "--follow")
        assert held.read_text() == "x", followed.stdout + followed.stderr
        answered = tether("run", "--confirm", "--answer", "run", "--device", "alpha", "--plan",
                          str(tmp_path / "ran.json"))
        assert answered.returncode == 0 and ran.read_text() == "x", answered.stdout + answered.stderr
        # a dry run on the server: the plan checked against alpha's tools and shown, nothing run or stored
        dry, bad = tmp_path / "dry.txt", tmp_path / "bad.json"
        (tmp_path / "dry.json").write_text(json.dumps(
            [{"skill": "write_file", "args": {"file_path": str(root / "dry.txt"), "content": "x"}}]))
        bad.write_text(json.dumps([{"skill": "no.such.tool", "args": {}}]))
        before = len(json.loads(tether("tasks", "--json").stdout))
        shown = tether("run", "--dry-run", "--device", "alpha", "--plan", str(tmp_path / "dry.json"))
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert "plan for alpha (dry run, nothing ran):" in shown.stdout and "1. write_file" in shown.stdout
        assert not (root / "dry.txt").exists() and not dry.exists()
        refused = tether("run", "--dry-run", "--device", "alpha", "--plan", str(bad))
        assert refused.returncode == 1 and "unknown skill 'no.such.tool'" in refused.stderr, refused.stderr
        assert len(json.loads(tether("tasks", "--json").stdout)) == before
    finally:
        cluster.close()


async def test_a_plan_waiting_for_confirmation_survives_a_server_restart(tmp_path: Path) -> None:
    from tests.kits.task import AgentServer
    from tether.tools.policy.model import default_policy

    root = tmp_path / "alpha"
    root.mkdir()
    policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
    db = tmp_path / "server.db"
    target = root / "later.txt"
    async with AgentServer(tmp_path, db_path=db) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        _, secret = server.store.tokens.create("api", "careful", ["read", "execute", "approve"], confirm="always")
        careful = {"Authorization": f"Bearer {secret}"}
        created = (await server.api.post("/tasks", json={"device": "alpha", "plan": [
            {"skill": "write_file", "args": {"file_path": str(target), "content": "later"}}]},
            headers=careful)).json()
        asked = await server.events_until(created["id"], lambda e: e["kind"] == "question")
        assert asked[-1]["data"]["kind"] == "confirmation"
    async with AgentServer(tmp_path, db_path=db) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha-2")
        waiting = (await server.api.get(f"/tasks/{created['id']}")).json()
        assert waiting["state"] == "waiting_for_user" and not target.exists()
        answered = await server.api.post(f"/tasks/{created['id']}/answer", json={"answer": "run"})
        assert answered.status_code == 200, answered.text
        done = await server.finished(created["id"])
    assert done["state"] == "done", done["error"]
    assert target.read_text() == "later"
    assert [e["kind"] for e in done["events"]].count("question") == 1  # resumed with its answer, not asked again
