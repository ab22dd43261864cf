"""The agent's task tools on the MCP gateway: the official SDK client over streamable HTTP against the whole
agent server (tasks extension, /mcp) and a real device (built-in tools, a real policy) connected over AIP."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import psutil
import pytest

from bench.kit.fake_llm import FakeLLM
from tests.kits.gateway import mcp_client
from tests.kits.netutil import wait_for
from tests.kits.task import WAIT, AgentServer
from tether.agent.run.task import TaskState
from tether.tools.policy.model import default_policy


@pytest.fixture
async def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[AgentServer, Path]]:
    """An agent server with device `alpha`, whose policy may write only under `root`."""
    other_temp = tmp_path / "device-temp"
    other_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(other_temp))
    root = tmp_path / "alpha"
    root.mkdir()
    policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
    async with AgentServer(tmp_path) as agent:
        await agent.add_device("alpha", policy, tmp_path / "state-alpha")
        yield agent, root


def url(agent: AgentServer) -> str:
    return f"http://127.0.0.1:{agent.port}/mcp"


def token(agent: AgentServer, name: str, *scopes: str) -> str:
    return agent.store.tokens.create("api", name, list(scopes))[1]


def shell(cmd: str, argv: list[str], cwd: Path) -> dict[str, Any]:
    return {"skill": "shell.run", "args": {"cmd": cmd, "argv": argv, "cwd": str(cwd)}}


class Progress:
    """Every progress notification; `started` is set once a step has started."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, float | None, str | None]] = []
        self.started = asyncio.Event()

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        self.seen.append((progress, total, message))
        if message and " started: " in message:
            self.started.set()

    def messages(self) -> list[str]:
        return [m or "" for _, _, m in self.seen]


def answering(choice: str, asked: list[types.ElicitRequestParams]) -> Callable[..., Any]:
    async def elicitation(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params)
        return types.ElicitResult(action="accept", content={"answer": choice})

    return elicitation


async def test_run_task_streams_each_step_and_its_output_as_progress(server: tuple[AgentServer, Path]) -> None:
    agent, root = server
    async with mcp_client(url(agent), token(agent, "ide", "execute"),
                          client_info=types.Implementation(name="ide", version="3")) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        progress = Progress()
        result = await client.call_tool("run_task", {"request": "make a folder and greet", "device": "alpha",
                                                     "plan": [shell("mkdir", [str(root / "demo")], root),
                                                              shell("echo", ["hi there"], root)]},
                                        progress_callback=progress)
    assert {"run_task", "get_task", "answer_task", "cancel_task", "undo_task", "list_devices"} <= set(listed)
    assert listed["run_task"].output_schema is not None and listed["get_task"].annotations.read_only_hint
    assert listed["undo_task"].annotations.destructive_hint
    assert not result.is_error, result.content
    summary = result.structured_content
    assert summary is not None and summary["status"] == "done" and summary["question"] is None
    assert [(s["skill"], s["status"]) for s in summary["steps"]] == [("shell.run", "success")] * 2
    assert (root / "demo").is_dir()
    messages = progress.messages()
    assert [p for p, _, _ in progress.seen] == sorted(p for p, _, _ in progress.seen)  # only ever grows
    assert any(m.startswith("step 1/2 started") for m in messages)
    assert any(m.startswith("step 2/2 output: ") and "hi there" in m for m in messages)
    assert "step 2/2 success" in messages
    audit = [r for r in agent.store.audit.rows(limit=10) if r["tool_name"] == "shell.run"]
    assert len(audit) == 2 and all(r["requested_by"].endswith("for mcp:ide/3 by api:ide") for r in audit), audit


async def test_an_approval_is_asked_through_elicitation_and_the_task_goes_on(server: tuple[AgentServer, Path]
                                                                             ) -> None:
    agent, root = server
    victim = root / "old"
    victim.mkdir()
    asked: list[types.ElicitRequestParams] = []
    async with mcp_client(url(agent), token(agent, "person", "execute", "approve"),
                          elicitation_callback=answering("approve", asked),
                          client_info=types.Implementation(name="desk", version="1")) as client:
        result = await client.call_tool("run_task", {"plan": [shell("rm", ["-r", str(victim)], root)],
                                                     "device": "alpha"})
    assert not result.is_error, result.content
    assert result.structured_content is not None and result.structured_content["status"] == "done"
    assert not victim.exists()
    [question] = asked
    assert question.requested_schema["properties"]["answer"]["enum"] == ["approve", "deny"]
    assert "rm" in question.message
    ran = [r for r in agent.store.audit.rows(limit=10) if r["tool_name"] == "shell.run"]
    assert [r["approved_by"] for r in reversed(ran)] == [None, "mcp:desk/1 by api:person"]


async def test_without_elicitation_the_question_comes_back_and_answer_task_finishes_it(
        server: tuple[AgentServer, Path]) -> None:
    agent, root = server
    victim = root / "old"
    victim.mkdir()
    async with mcp_client(url(agent), token(agent, "agent", "execute")) as agent_client, \
            mcp_client(url(agent), token(agent, "person", "execute", "approve")) as person:
        waiting = await agent_client.call_tool("run_task", {"plan": [shell("rm", ["-r", str(victim)], root)],
                                                            "device": "alpha"})
        summary = waiting.structured_content
        assert not waiting.is_error and summary is not None and summary["status"] == "waiting_for_user"
        assert summary["question"]["kind"] == "approval" and "answer_task" in summary["how_to_answer"]
        assert "answer_task" in waiting.content[0].text and summary["task_id"] in waiting.content[0].text
        assert victim.exists()
        seen = await agent_client.call_tool("get_task", {"task_id": summary["task_id"][:10]})
        assert seen.structured_content is not None and seen.structured_content["question"] == summary["question"]
        refused = await agent_client.call_tool("answer_task", {"task_id": summary["task_id"], "approved": True})
        assert refused.is_error and "lacks the 'approve' scope" in refused.content[0].text
        assert victim.exists()
        wrong = await person.call_tool("answer_task", {"task_id": summary["task_id"], "approved": "yes"})
        assert wrong.is_error and "true or false" in wrong.content[0].text
        done = await person.call_tool("answer_task", {"task_id": summary["task_id"], "approved": True})
    assert not done.is_error, done.content
    assert done.structured_content is not None and done.structured_content["status"] == "done"
    assert not victim.exists()


async def test_get_cancel_and_undo_task(server: tuple[AgentServer, Path]) -> None:
    agent, root = server
    (root / "keep.txt").write_text("original")
    overwrite = {"skill": "write_file", "args": {"file_path": str(root / "keep.txt"), "content": "changed",
                                                 "mode": "overwrite"}}
    async with mcp_client(url(agent), token(agent, "person", "execute", "approve")) as client, \
            mcp_client(url(agent), token(agent, "reader", "read")) as reader:
        # a task waiting on its approval is cancelled
        waiting = await client.call_tool("run_task", {"plan": [overwrite], "device": "alpha"})
        task_id = (waiting.structured_content or {})["task_id"]
        cancelled = await client.call_tool("cancel_task", {"task_id": task_id})
        assert cancelled.structured_content is not None and cancelled.structured_content["status"] == "cancelled"
        again = await client.call_tool("cancel_task", {"task_id": task_id})
        assert again.is_error and "already ended" in again.content[0].text
        # one approved with answer_task, then undone
        waiting = await client.call_tool("run_task", {"plan": [overwrite], "device": "alpha"})
        task_id = (waiting.structured_content or {})["task_id"]
        done = await client.call_tool("answer_task", {"task_id": task_id, "answer": "approve"})
        assert (done.structured_content or {}).get("status") == "done", done.content
        assert (root / "keep.txt").read_text() == "changed"
        read = await reader.call_tool("get_task", {"task_id": task_id})
        denied = await reader.call_tool("undo_task", {"task_id": task_id})
        undone = await client.call_tool("undo_task", {"task_id": task_id})
        missing = await reader.call_tool("get_task", {"task_id": "nope"})
        empty = await client.call_tool("run_task", {})
        unknown = await client.call_tool("run_task", {"request": "x", "colour": "red"})
    assert read.structured_content is not None and read.structured_content["steps"][0]["status"] == "success"
    assert denied.is_error and "lacks the 'execute' scope" in denied.content[0].text
    assert not undone.is_error, undone.content
    assert undone.structured_content is not None and "restored" in undone.structured_content["devices"]["alpha"]
    assert (root / "keep.txt").read_text() == "original"
    assert missing.is_error and "no task 'nope'" in missing.content[0].text
    assert empty.is_error and "plan" in empty.content[0].text
    assert unknown.is_error and "colour" in unknown.content[0].text


async def test_the_clients_cancellation_cancels_the_task_and_its_command(server: tuple[AgentServer, Path]) -> None:
    agent, root = server
    async with mcp_client(url(agent), token(agent, "ide", "execute")) as client:
        progress = Progress()

        async def run() -> None:
            await client.call_tool("run_task", {"plan": [shell("sleep", ["300"], root)], "device": "alpha"},
                                   progress_callback=progress)

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await asyncio.wait_for(progress.started.wait(), WAIT)
            # the device runs in this process; its command's process is a child: netutil's poll, in a thread
            process = await anyio.to_thread.run_sync(wait_for, sleeper, "sleep 300 started on the device", WAIT)
            assert isinstance(process, psutil.Process)
            group.cancel_scope.cancel()  # the SDK sends notifications/cancelled
        [listed] = agent.tasks.list(1)
        task = await asyncio.wait_for(agent.tasks.wait(listed["id"]), WAIT)
        # psutil.TimeoutExpired if the command was left running
        await anyio.to_thread.run_sync(lambda: process.wait(timeout=WAIT))
    assert task.state is TaskState.CANCELLED
    assert not process.is_running()


def sleeper() -> psutil.Process | None:
    return next((p for p in psutil.Process().children(recursive=True)
                 if p.name() == "sleep" and "300" in p.cmdline()), None)


async def test_a_request_in_words_is_planned_and_its_question_asked_with_the_options_as_an_enum(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other_temp = tmp_path / "device-temp"
    other_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(other_temp))
    root = tmp_path / "alpha"
    root.mkdir()
    (root / "b.txt").write_text("bee")
    policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
    first = {"steps": [{"skill": "read_file", "args": {"file_path": str(root / "which.txt")}}]}
    question = {"decision": "ASK_USER", "question": "Which file did you mean?", "options": ["a.txt", "b.txt"]}
    second = {"steps": [{"skill": "read_file", "args": {"file_path": str(root / "b.txt")}}]}
    asked: list[types.ElicitRequestParams] = []
    async with FakeLLM([json.dumps(first), json.dumps(question), json.dumps(second), "It says bee."]) as fake, \
            AgentServer(tmp_path, llm=fake.settings()) as agent:
        await agent.add_device("alpha", policy, tmp_path / "state-alpha")
        async with mcp_client(url(agent), token(agent, "ide", "execute"),
                              elicitation_callback=answering("b.txt", asked)) as client:
            progress = Progress()
            result = await client.call_tool("run_task", {"request": "read the file", "device": "alpha"},
                                            progress_callback=progress)
    assert not result.is_error, result.content
    assert result.content[0].text == "It says bee."
    assert result.structured_content is not None and result.structured_content["answer"] == "It says bee."
    [params] = asked
    assert "Which file did you mean?" in params.message
    assert params.requested_schema["properties"]["answer"]["enum"] == ["a.txt", "b.txt"]
    assert "waiting for an answer: Which file did you mean?" in progress.messages()


@pytest.mark.parametrize("action", ["decline", "cancel"])
async def test_a_declined_approval_denies_and_a_dismissed_one_stays_open(server: tuple[AgentServer, Path],
                                                                         action: str) -> None:
    agent, root = server
    victim = root / "old"
    victim.mkdir()

    async def dismiss(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        return types.ElicitResult(action=action)  # type: ignore[arg-type]

    async with mcp_client(url(agent), token(agent, "person", "execute", "approve"),
                          elicitation_callback=dismiss) as client:
        result = await client.call_tool("run_task", {"plan": [shell("rm", ["-r", str(victim)], root)],
                                                     "device": "alpha"})
    summary = result.structured_content
    assert summary is not None and victim.exists()
    if action == "decline":  # a person said no: the task is cancelled, as a denial through the API
        assert summary["status"] == "cancelled" and "not approved" in summary["error"]
    else:  # nobody answered: the question stays open, with how to answer it
        assert summary["status"] == "waiting_for_user" and "answer_task" in summary["how_to_answer"]


async def test_an_agents_edit_of_a_running_graph_waits_for_a_persons_confirmation(
        server: tuple[AgentServer, Path]) -> None:
    agent, root = server
    (root / "keep.txt").write_text("original")
    held = {"id": "held", "needs": [], "skill": "write_file",  # waits for approval: the graph keeps running
            "args": {"file_path": str(root / "keep.txt"), "content": "changed", "mode": "overwrite"}}
    added = {"id": "added", "needs": [], "device": "alpha", "skill": "write_file",
             "args": {"file_path": str(root / "added.txt"), "content": "from the agent"}}
    robot = agent.store.tokens.create("api", "robot", ["read", "execute"], "destructive", agent=True)[1]
    async with mcp_client(url(agent), token(agent, "person", "execute", "approve")) as person, \
            mcp_client(url(agent), robot) as bot:
        listed = {t.name: t for t in (await bot.list_tools()).tools}
        waiting = await person.call_tool("run_task", {"plan": [held], "device": "alpha"})
        task_id = (waiting.structured_content or {})["task_id"]
        itself = await bot.call_tool("edit_task", {"task_id": task_id, "add": [{**added, "needs": ["added"]}]})
        edit = await bot.call_tool("edit_task", {"task_id": task_id, "add": [added]})
        assert not edit.is_error, edit.content
        assert (edit.structured_content or {})["status"] == "waiting_for_confirmation"
        approved = await person.call_tool("answer_task", {"task_id": task_id, "answer": "approve", "wait": False})
        assert not approved.is_error, approved.content
        await agent.events_until(task_id, lambda e: e["kind"] == "question"
                                 and e["data"]["kind"] == "confirmation")
        assert not (root / "added.txt").exists()  # nothing an agent adds runs before a person confirms it
        self_confirmed = await bot.call_tool("answer_task", {"task_id": task_id, "answer": "run", "wait": False})
        confirmed = await person.call_tool("answer_task", {"task_id": task_id, "answer": "run"})
    assert "anyOf" not in listed["edit_task"].input_schema and "oneOf" not in listed["edit_task"].input_schema
    assert itself.is_error and "cannot need itself" in itself.content[0].text
    assert self_confirmed.is_error and "approve" in self_confirmed.content[0].text
    assert (confirmed.structured_content or {}).get("status") == "done", confirmed.content
    assert (root / "added.txt").read_text() == "from the agent" and (root / "keep.txt").read_text() == "changed"
    task = (await agent.api.get(f"/tasks/{task_id}")).json()
    [applied] = [e["data"] for e in task["events"] if e["kind"] == "edit"]
    assert applied["by"].endswith("api:robot") and task["step_states"] == ["done", "done"]
