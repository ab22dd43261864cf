"""A task's questions belong to whoever the task acts for (issue 27: a task's MCP questions kept an older
rule, under which any person holding `approve` who could see the task answered them).

Tried as an attacker would, on one `tether server --four-eyes` process and one `tether device` process
serving tests/servers/consenting.py (a real stdio MCP server that elicits), over REST with server-sent
events and through the MCP gateway with the official SDK: another person answers a person's task's
question (refused at the task route and at the device route, and the question still waits for its
owner); the task's creator consents to its own step under four-eyes (refused; another person does); an
agent's task's question is put to neither that agent nor another agent, through REST or MCP (a person
answers it); the asker is saved with the task.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import mcp_types as types
import pytest

from tests.kits import db as dbkit
from tests.kits.gateway import mcp_client
from tests.kits.netutil import Cluster, wait_for
from tests.kits.sse import sse_events
from tether.agent.tasks.store import TaskStore

CONSENTING = str(Path(__file__).parent.parent / "servers" / "consenting.py")
# who tries what: (token, route "task" | "device", answer, expected status)
Attempt = tuple[str, str, Any, int]


class Office:
    """The four-eyes server, device `alpha` serving the consenting MCP server, and tokens: alice and bob
    (people holding approve), carol (a person holding approve for device beta only), robot and droid (agents)."""

    def __init__(self, cluster: Cluster, tmp: Path) -> None:
        self.cluster = cluster
        config = tmp / "mcp.json"
        config.write_text(json.dumps({"mcpServers": {"consenting": {"command": sys.executable,
                                                                      "args": [CONSENTING]}}}))
        proc = cluster.device("alpha", extra=("--config", str(config)))
        self.proc = proc
        cluster.wait_online("alpha", proc)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{cluster.port}/api/v1", timeout=60)
        self.secrets: dict[str, str] = {}
        for name, scopes, agent, devices in (("alice", ["read", "execute", "approve"], False, []),
                                             ("bob", ["read", "execute", "approve"], False, []),
                                             ("carol", ["read", "execute", "approve"], False, ["beta"]),
                                             ("robot", ["read", "execute"], True, []),
                                             ("droid", ["read", "execute"], True, [])):
            made = self.http.post("/tokens", json={"kind": "api", "name": name, "scopes": scopes, "agent": agent,
                                                   "devices": devices},
                                  headers={"Authorization": f"Bearer {cluster.api_token}"})
            assert made.status_code == 201, made.text
            self.secrets[name] = made.json()["token"]
        # the external server starts after the device registers: its tools are listed once it is up
        wait_for(lambda: "drop_record" in self.http.get("/devices/alpha/tools", headers=self.auth("alice")).text,
                 "alpha lists the consenting server's tools", 60, (proc.popen,))
        self.refusals: list[str] = []  # the error of every refused attempt, in order

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secrets[who]}"}

    def answer(self, who: str, route: str, task_id: str, question: str, answer: Any) -> httpx.Response:
        """`who` answers the MCP server's question through the task's route or the device's."""
        if route == "task":
            return self.http.post(f"/tasks/{task_id}/answer", json={"answer": answer}, headers=self.auth(who))
        action, content = answer if isinstance(answer, tuple) else ("accept", answer)
        return self.http.post(f"/devices/alpha/questions/{question}", json={"action": action, "content": content},
                              headers=self.auth(who))

    def online(self) -> None:
        """alpha is connected (the kit's 2 s heartbeat may have dropped it for a moment on a loaded machine)."""
        self.cluster.wait_online("alpha", self.proc)

    def task(self, who: str, tool: str, args: dict[str, Any], attempts: list[Attempt]) -> tuple[dict[str, Any],
                                                                                                dict[str, Any]]:
        """`who` creates a task of one step (`tool` on alpha); when its MCP server asks, each attempt is
        tried in order and must get its status. The question's event data and the task's end."""
        self.online()
        made = self.http.post("/tasks", json={"plan": [{"skill": tool, "args": args}], "device": "alpha"},
                              headers=self.auth(who))
        assert made.status_code == 201, made.text
        return self.follow(made.json()["id"], attempts)

    def follow(self, task_id: str, attempts: list[Attempt]) -> tuple[dict[str, Any], dict[str, Any]]:
        asked: dict[str, Any] = {}
        end: dict[str, Any] = {}
        with self.http.stream("GET", f"/tasks/{task_id}/events", headers=self.auth("bob")) as stream:
            for kind, event in sse_events(stream.iter_lines()):
                if kind == "task_event":
                    if event["kind"] == "elicitation" and "id" in event["data"] and not asked:
                        asked = event["data"]
                        for who, route, answer, status in attempts:
                            tried = self.answer(who, route, task_id, asked["id"], answer)
                            assert tried.status_code == status, (who, route, tried.status_code, tried.text)
                            if status >= 400:
                                assert set(tried.json()) == {"error"}, tried.text
                                self.refusals.append(tried.json()["error"])
                elif kind == "end":
                    end = event
                    break
        assert asked, f"the MCP server asked nothing: {end}"
        return asked, end

    def close(self) -> None:
        self.http.close()


@pytest.fixture(scope="module")
def office(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Office]:
    tmp = tmp_path_factory.mktemp("task-questions")
    cluster = Cluster(tmp, server_args=("--four-eyes",))
    try:
        o = Office(cluster, tmp)
        yield o
        o.close()
    finally:
        cluster.close()


def test_another_person_cannot_answer_a_persons_task_question(office: Office) -> None:
    # bob holds approve for every device and sees the task, yet the question raised in alice's task is hers:
    # refused at the task's route and at the device's, and it still waits; carol (approve for beta only)
    # does not even see it; an agent never answers. alice answers, under four-eyes too (it asks information)
    asked, end = office.task("alice", "pick_colour", {"question": "Which colour?"}, [
        ("bob", "task", "black", 403),
        ("bob", "device", {"colour": "black"}, 403),
        ("carol", "device", {"colour": "black"}, 404),
        ("robot", "task", "black", 403),
        ("alice", "task", "green", 200)])
    assert asked["asker"] == "alice" and asked["asker_agent"] is False and asked["approval"] is False
    assert end["state"] == "done", end
    task = office.http.get(f"/tasks/{end['id']}", headers=office.auth("alice")).json()
    outputs = json.dumps([s["result"] for s in task["steps"]])
    assert "accept: green" in outputs and "accept: black" not in outputs, outputs
    assert task["asker"] == {"name": "alice", "agent": False, "sample": False}
    # saved with the task (a restarted server reads it back from here)
    store = TaskStore(dbkit.server_db(office.cluster.db))  # the server's own database, SQLite or PostgreSQL
    try:
        saved = store.get(end["id"])
    finally:
        store.close()
    assert saved is not None and saved.asker is not None
    assert saved.asker.model_dump() == {"name": "alice", "agent": False, "sample": False}


def test_four_eyes_the_tasks_creator_cannot_consent_to_its_step(office: Office) -> None:
    asked, end = office.task("alice", "drop_record", {"name": "orders"}, [
        ("alice", "task", "yes", 403),
        ("alice", "device", {"confirm": True}, 403),
        ("droid", "task", "yes", 403),
        ("bob", "device", {"confirm": True}, 200)])
    assert asked["asker"] == "alice" and asked["approval"] is True
    assert end["state"] == "done", end
    task = office.http.get(f"/tasks/{end['id']}", headers=office.auth("alice")).json()
    assert "dropped orders" in json.dumps([s["result"] for s in task["steps"]])


def test_refusals_say_whose_question_it_is_and_how_a_person_answers(office: Office) -> None:
    office.refusals.clear()
    asked, end = office.task("alice", "drop_record", {"name": "users"}, [
        ("alice", "task", "yes", 403), ("robot", "task", "yes", 403), ("bob", "task", "no", 200)])
    assert asked["approval"] is True and end["state"] == "done"
    four_eyes, agent = office.refusals
    assert "four-eyes" in four_eyes and "another person" in four_eyes, four_eyes
    assert "'robot' is an agent's token" in agent and "dashboard" in agent, agent
    late = office.answer("bob", "task", end["id"], asked["id"], "yes")  # nothing waits any more
    assert late.status_code == 409 and set(late.json()) == {"error"}, late.text


async def test_an_agents_task_question_goes_to_a_person_never_an_agent(office: Office) -> None:
    """robot runs the task through the MCP gateway with a client that would answer anything: its client is
    never asked, its answer_task is refused, another agent's REST answer is refused; bob answers."""
    asked: list[str] = []

    async def elicitation(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"colour": "red"})

    url = f"http://127.0.0.1:{office.cluster.port}/mcp"
    async with mcp_client(url, office.secrets["robot"], elicitation_callback=elicitation) as client:
        await anyio.to_thread.run_sync(office.online)  # the gateway's first session may stall a loaded server
        ran = await client.call_tool("run_task", {"plan": [{"skill": "pick_colour",
                                                            "args": {"question": "Which colour?"}}],
                                                  "device": "alpha"})
        task_id = (ran.structured_content or {}).get("task_id")
        assert task_id and not ran.is_error, ran
        mine = await client.call_tool("answer_task", {"task_id": task_id, "answer": "red", "wait": False})
        text = " ".join(getattr(c, "text", "") for c in mine.content)
        assert mine.is_error and "agent" in text, mine
    assert asked == []  # the agent's client was never asked its own task's question

    def attempts() -> tuple[dict[str, Any], dict[str, Any]]:
        return office.follow(task_id, [("droid", "task", "red", 403),
                                       ("robot", "device", {"colour": "red"}, 403),
                                       ("bob", "device", {"colour": "blue"}, 200)])

    question, end = await anyio.to_thread.run_sync(attempts)
    assert question["asker"] == "robot" and question["asker_agent"] is True
    assert end["state"] == "done", end
    task = office.http.get(f"/tasks/{task_id}", headers=office.auth("bob")).json()
    outputs = json.dumps([s["result"] for s in task["steps"]])
    assert "accept: blue" in outputs and "accept: red" not in outputs, outputs
    assert task["asker"] == {"name": "robot", "agent": True, "sample": False}


async def test_a_persons_own_client_is_asked_its_information_question(office: Office) -> None:
    """Under four-eyes alice's MCP client is asked the information question of her own task (the old task
    rule refused her: four-eyes compared the creator, not the kind of question)."""
    asked: list[str] = []

    async def elicitation(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"colour": "teal"})

    url = f"http://127.0.0.1:{office.cluster.port}/mcp"
    async with mcp_client(url, office.secrets["alice"], elicitation_callback=elicitation) as client:
        await anyio.to_thread.run_sync(office.online)
        ran = await client.call_tool("run_task", {"plan": [{"skill": "pick_colour",
                                                            "args": {"question": "Which colour?"}}],
                                                  "device": "alpha"})
    assert not ran.is_error, ran
    assert len(asked) == 1 and "Which colour?" in asked[0]
    task_id = (ran.structured_content or {})["task_id"]
    task = office.http.get(f"/tasks/{task_id}", headers=office.auth("alice")).json()
    assert task["state"] == "done" and "accept: teal" in json.dumps([s["result"] for s in task["steps"]]), task
