"""An external MCP server's question belongs to the command that raised it (issue 27, "scopes that are not
scopes": any approve-scope token could answer anyone's question).

Tried as an attacker would: a second person's token answers a question asked during someone else's
command (refused, 403, and the question still waits for its caller); an agent's command's question goes
to a person; with four-eyes on, the person who ran the command cannot give the consent its MCP server asks
for (another person does), while a question asking for information stays theirs. Real things only: a
`tether server` process, a `tether device` process serving tests/servers/consenting.py (a real stdio MCP
server that elicits), REST with server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import mcp_types as types
import pytest

from tests.kits.gateway import mcp_client
from tests.kits.netutil import Cluster
from tests.kits.sse import async_sse_events, sse_events

CONSENTING = str(Path(__file__).parent.parent / "servers" / "consenting.py")


def mcp_config(tmp_path: Path) -> Path:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"consenting": {"command": sys.executable, "args": [CONSENTING]}}}))
    return path


class People:
    """The server, device `alpha` serving the consenting MCP server, and three API tokens: alice and bob
    (people holding approve) and an agent's (read, execute); `secrets` are the tokens themselves."""

    def __init__(self, cluster: Cluster, tmp_path: Path) -> None:
        self.cluster = cluster
        proc = cluster.device("alpha", extra=("--config", str(mcp_config(tmp_path))))
        cluster.wait_online("alpha", proc)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{cluster.port}", timeout=60)
        self.tokens: dict[str, dict[str, str]] = {}
        self.secrets: dict[str, str] = {}
        for name, scopes, agent in (("alice", ["read", "execute", "approve"], False),
                                    ("bob", ["read", "execute", "approve"], False),
                                    ("robot", ["read", "execute"], True)):
            made = self.http.post("/api/v1/tokens", json={"kind": "api", "name": name, "scopes": scopes,
                                                          "agent": agent},
                                  headers={"Authorization": f"Bearer {cluster.api_token}"})
            assert made.status_code == 201, made.text
            self.tokens[name] = {"Authorization": f"Bearer {made.json()['token']}"}
            self.secrets[name] = made.json()["token"]

    def close(self) -> None:
        self.http.close()

    def run(self, who: str, tool: str, params: dict[str, Any]) -> Iterator[tuple[str, Any]]:
        """(event, data) pairs of `who` running `tool` on alpha with a server-sent event stream."""
        body = {"commands": [{"tool_name": tool, "parameters": params}], "timeout": 60}
        headers = {**self.tokens[who], "Accept": "text/event-stream"}
        with self.http.stream("POST", "/api/v1/devices/alpha/commands", json=body, headers=headers) as response:
            assert response.status_code == 200, response.read()
            yield from sse_events(response.iter_lines())

    def answer(self, who: str, question: str, action: str, content: dict[str, Any] | None) -> httpx.Response:
        return self.http.post(f"/api/v1/devices/alpha/questions/{question}",
                              json={"action": action, "content": content}, headers=self.tokens[who])

    def ask_and_answer(self, caller: str, tool: str, params: dict[str, Any],
                       attempts: list[tuple[str, str, dict[str, Any] | None, int]]) -> tuple[dict[str, Any], Any]:
        """`caller` runs `tool`; when its MCP server asks, each (who, action, content, status) answer is
        tried in order and must get `status`. The question's event data and the command's result."""
        asked: dict[str, Any] = {}
        result: Any = None
        for name, data in self.run(caller, tool, params):
            if name == "event" and data["kind"] == "elicitation":
                asked = data["data"]
                for who, action, content, status in attempts:
                    tried = self.answer(who, asked["id"], action, content)
                    assert tried.status_code == status, (who, tried.status_code, tried.text)
                    if status == 403:
                        assert set(tried.json()) == {"error"}, tried.text
            elif name == "results":
                [result] = data["results"]
                break
        assert asked, f"the MCP server asked nothing: {result}"
        return asked, result


@pytest.fixture
def people(tmp_path: Path) -> Iterator[People]:
    cluster = Cluster(tmp_path)
    p = People(cluster, tmp_path)
    yield p
    p.close()
    cluster.close()


@pytest.fixture
def four_eyes(tmp_path: Path) -> Iterator[People]:
    cluster = Cluster(tmp_path, server_args=("--four-eyes",))
    p = People(cluster, tmp_path)
    yield p
    p.close()
    cluster.close()


def test_another_person_cannot_answer_a_callers_question(people: People) -> None:
    # bob holds approve for every device, yet the question asked during alice's command is hers: refused,
    # and it still waits — alice answers it and her command goes on with her answer, not bob's
    refused: list[str] = []
    asked: dict[str, Any] = {}
    result: Any = None
    for name, data in people.run("alice", "pick_colour", {"question": "Which colour?"}):
        if name == "event" and data["kind"] == "elicitation":
            asked = data["data"]
            tried = people.answer("bob", asked["id"], "accept", {"colour": "black"})
            assert tried.status_code == 403, tried.text
            refused.append(tried.json()["error"])
            ok = people.answer("alice", asked["id"], "accept", {"colour": "green"})
            assert ok.status_code == 200, ok.text
        elif name == "results":
            [result] = data["results"]
            break
    # the person sees whose question it is and what kind; the refusal names who answers and how
    assert asked["asker"] == "alice" and asked["asker_agent"] is False and asked["approval"] is False
    [error] = refused
    assert "'alice'" in error and "'bob' may not" in error and "/api/v1/devices/alpha/questions/" in error, error
    assert result["status"] == "success" and "accept: green" in json.dumps(result["result"]), result


def test_an_agents_question_goes_to_a_person(people: People) -> None:
    asked, result = people.ask_and_answer("robot", "pick_colour", {"question": "Which colour?"}, [
        ("robot", "accept", {"colour": "red"}, 403),  # an agent never answers (no approve, and never could)
        ("bob", "accept", {"colour": "blue"}, 200)])
    assert asked["asker"] == "robot" and asked["asker_agent"] is True
    assert result["status"] == "success" and "accept: blue" in json.dumps(result["result"]), result


def test_the_caller_answers_its_own_consent_question_without_four_eyes(people: People) -> None:
    asked, result = people.ask_and_answer("alice", "drop_record", {"name": "orders"}, [
        ("bob", "accept", {"confirm": True}, 403),
        ("alice", "accept", {"confirm": True}, 200)])
    assert asked["approval"] is True
    assert "dropped orders" in json.dumps(result["result"]), result


def test_four_eyes_the_requester_cannot_consent_to_its_own_command(four_eyes: People) -> None:
    asked, result = four_eyes.ask_and_answer("alice", "drop_record", {"name": "orders"}, [
        ("alice", "accept", {"confirm": True}, 403),
        ("bob", "decline", None, 200)])
    assert asked["asker"] == "alice" and asked["approval"] is True
    assert result["status"] == "success" and "decline" in json.dumps(result["result"]), result
    _, again = four_eyes.ask_and_answer("alice", "drop_record", {"name": "invoices"}, [
        ("bob", "accept", {"confirm": True}, 200)])
    assert "dropped invoices" in json.dumps(again["result"]), again


def test_four_eyes_refusal_names_four_eyes(four_eyes: People) -> None:
    for name, data in four_eyes.run("alice", "drop_record", {"name": "users"}):
        if name == "event" and data["kind"] == "elicitation":
            mine = four_eyes.answer("alice", data["data"]["id"], "accept", {"confirm": True})
            assert mine.status_code == 403 and "four-eyes" in mine.json()["error"], mine.text
            assert four_eyes.answer("bob", data["data"]["id"], "decline", None).status_code == 200
        elif name == "results":
            break


def test_four_eyes_leaves_an_information_question_to_its_caller(four_eyes: People) -> None:
    asked, result = four_eyes.ask_and_answer("alice", "pick_colour", {"question": "Which colour?"}, [
        ("bob", "accept", {"colour": "black"}, 403),
        ("alice", "accept", {"colour": "teal"}, 200)])
    assert asked["approval"] is False
    assert "accept: teal" in json.dumps(result["result"]), result


async def test_the_gateway_asks_its_client_only_what_the_caller_may_answer(four_eyes: People) -> None:
    """Through the MCP gateway: alice's client is asked the information question of her call and answers it;
    under four-eyes the consent question of her next call is not put to her client (she may not give it):
    it waits, and bob answers it over REST."""
    asked: list[str] = []

    async def elicitation(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"colour": "teal"})

    url = f"http://127.0.0.1:{four_eyes.cluster.port}/mcp"
    questions: list[dict[str, Any]] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        if message and message.startswith("elicitation: "):
            questions.append(json.loads(message.removeprefix("elicitation: ")))

    async def bob_answers() -> None:
        with anyio.fail_after(60):
            while not questions:
                await anyio.sleep(0.05)
        answered = await anyio.to_thread.run_sync(
            lambda: four_eyes.answer("bob", questions[0]["id"], "accept", {"confirm": True}))
        assert answered.status_code == 200, answered.text

    async with mcp_client(url, four_eyes.secrets["alice"], elicitation_callback=elicitation) as client:
        with anyio.fail_after(60):  # the device lists its external server's tools once that server has started
            while "alpha__drop_record" not in {t.name for t in (await client.list_tools()).tools}:
                await anyio.sleep(0.2)
        colour = await client.call_tool("alpha__pick_colour", {"question": "Which colour?"})
        assert not colour.is_error and "accept: teal" in json.dumps(colour.structured_content), colour
        assert len(asked) == 1 and "Which colour?" in asked[0]
        async with anyio.create_task_group() as group:
            group.start_soon(bob_answers)
            dropped = await client.call_tool("alpha__drop_record", {"name": "orders"}, progress_callback=progress)
    assert not dropped.is_error and "dropped orders" in json.dumps(dropped.structured_content), dropped
    assert len(asked) == 1  # the consent question never reached alice's client
    assert questions[0]["asker"] == "alice" and questions[0]["approval"] is True


async def test_over_a_cluster_the_node_holding_the_batch_decides(tmp_path: Path) -> None:
    """Two nodes on one Redis; alpha is held by n2, alice's command arrives at n1. bob answering at either
    node is refused (n2 holds the batch n1 routed, with its caller); alice's answer given at n1 is carried,
    with who gave it, to n2, which sends it on."""
    from bench.kit.engines import redis_server
    from tests.kits.cluster import ClusterKit

    with redis_server() as engine:
        async with ClusterKit(tmp_path, redis=engine) as kit:
            n1, n2 = await kit.start_node("n1"), await kit.start_node("n2")
            device = await kit.start_device("alpha", [n2], extra=["--config", str(mcp_config(tmp_path))])
            await device.registered()  # given n2 only: held there
            secrets: dict[str, str] = {}
            for name in ("alice", "bob"):
                made = await kit.http(n1).post("/tokens", json={"kind": "api", "name": name,
                                                                "scopes": ["read", "execute", "approve"]})
                assert made.status_code == 201, made.text
                secrets[name] = made.json()["token"]

            async def answer(who: str, node: Any, question: str, colour: str) -> httpx.Response:
                async with httpx.AsyncClient(base_url=f"{node.url}/api/v1", timeout=30) as http:
                    return await http.post(f"/devices/alpha/questions/{question}",
                                           json={"action": "accept", "content": {"colour": colour}},
                                           headers={"Authorization": f"Bearer {secrets[who]}"})

            async def run(attempts: list[tuple[str, Any, str, int]]) -> dict[str, Any]:
                body = {"commands": [{"tool_name": "pick_colour", "parameters": {"question": "Which colour?"}}],
                        "timeout": 60}
                headers = {"Authorization": f"Bearer {secrets['alice']}", "Accept": "text/event-stream"}
                result = None
                async with httpx.AsyncClient(base_url=f"{n1.url}/api/v1", timeout=httpx.Timeout(90)) as http, \
                        http.stream("POST", "/devices/alpha/commands", json=body, headers=headers) as response:
                    assert response.status_code == 200, await response.aread()
                    async for kind, event in async_sse_events(response.aiter_lines()):
                        if kind == "event" and event["kind"] == "elicitation":
                            assert event["data"]["asker"] == "alice", event
                            for who, node, colour, status in attempts:
                                tried = await answer(who, node, event["data"]["id"], colour)
                                assert tried.status_code == status, (who, node.name, tried.text)
                        elif kind == "results":
                            [result] = event["results"]
                            break
                assert result is not None
                return result

            # the external server starts after the device registers: wait until n2's device lists its tools
            async with asyncio.timeout(60):
                while "pick_colour" not in json.dumps((await kit.http(n2).get("/devices/alpha/tools")).json()):
                    await asyncio.sleep(0.2)
            first = await run([("bob", n1, "black", 403), ("bob", n2, "black", 403), ("alice", n1, "green", 200)])
            assert "accept: green" in json.dumps(first["result"]), first
            second = await run([("bob", n2, "black", 403), ("alice", n2, "red", 200)])
            assert "accept: red" in json.dumps(second["result"]), second


def test_the_inbox_shows_a_question_to_whom_may_answer_it_and_the_cli_answers(people: People) -> None:
    """GET /api/v1/approvals and `tether approvals` (docs/approvals.md): an agent's command's question is in a
    person's inbox and never in the agent's; the caller's own consent question is in the caller's; each is
    answered through the inbox's CLI, and leaves the inbox once answered."""
    import subprocess

    from tests.kits.netutil import CLI

    def cli(who: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**people.cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{people.cluster.port}",
               "TETHER_TOKEN": people.secrets[who]}
        return subprocess.run([*CLI, "approvals", *args], capture_output=True, text=True, env=env, timeout=60,
                              check=False)

    def inbox(who: str) -> list[dict[str, Any]]:
        answer = people.http.get("/api/v1/approvals", headers=people.tokens[who])
        assert answer.status_code == 200, answer.text
        return answer.json()

    for tool, params, caller, answerer, how, want in (
            ("pick_colour", {"question": "Which colour?"}, "robot", "bob", ("answer", "blue"), "accept: blue"),
            ("drop_record", {"name": "orders"}, "alice", "alice", ("approve",), "dropped orders")):
        result: Any = None
        for name, data in people.run(caller, tool, params):
            if name == "event" and data["kind"] == "elicitation":
                item = f"alpha/{data['data']['id']}"
                shown = inbox(answerer)
                assert [i["id"] for i in shown] == [item], shown
                assert shown[0]["kind"] == ("question" if tool == "pick_colour" else "approval")
                assert inbox("robot") == []  # an agent's token never answers, so nothing waits for it
                listed = cli(answerer)
                assert listed.returncode == 3 and item in listed.stdout, listed.stdout + listed.stderr
                done = cli(answerer, how[0], item, *how[1:])
                assert done.returncode == 0, done.stderr
            elif name == "results":
                [result] = data["results"]
                break
        assert result is not None and want in json.dumps(result["result"]), result
        assert inbox(answerer) == []


def test_approve_never_makes_a_choice_the_person_did_not(people: People) -> None:
    """`tether approvals approve` on a question that asks to choose (no yes among its choices, the worse one
    first, as the MCP server ordered them) sends nothing and says to answer it; the person's own choice goes."""
    import subprocess

    from tests.kits.netutil import CLI

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**people.cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{people.cluster.port}",
               "TETHER_TOKEN": people.secrets["bob"]}
        return subprocess.run([*CLI, "approvals", *args], capture_output=True, text=True, env=env, timeout=60,
                              check=False)

    result: Any = None
    for name, data in people.run("robot", "choose_fate", {"question": "What about the backups?"}):
        if name == "event" and data["kind"] == "elicitation":
            item = f"alpha/{data['data']['id']}"
            refused = cli("approve", item)
            assert refused.returncode == 2 and "not a yes; nothing was sent" in refused.stderr, refused.stderr
            assert "wipe the backups, keep them" in refused.stderr and "Traceback" not in refused.stderr
            chosen = cli("answer", item, "keep them")
            assert chosen.returncode == 0, chosen.stderr
        elif name == "results":
            [result] = data["results"]
            break
    assert result is not None and "chose: keep them" in json.dumps(result["result"]), result
