"""The compact planner for small models (`llm.plan_compact`): which skills it offers, the schema it sends (paths
the request names as the only values a path argument may take) and the checks after the reply, against the
scripted Chat Completions server (the real model's answers are in test_llm_real.py)."""

from __future__ import annotations

import json

from bench.kit.fake_llm import FakeLLM
from tether.agent.llm.chat import LLMClient
from tether.agent.planning import compact
from tether.agent.planning.device_view import DeviceView
from tether.agent.planning.planner import plan_request
from tether.tools.files.tool import files_toolset
from tether.tools.shell.tool import shell_toolset
from tether.tools.system.tool import system_toolset

TOOLS = shell_toolset().infos() + files_toolset().infos() + system_toolset().infos()


def names(request: str) -> list[str]:
    return [t.name for t in compact.rank_skills(request, TOOLS)]


def test_only_the_skills_the_request_asks_for_are_offered() -> None:
    assert names("Delete the file /srv/x/old.log") == ["delete_file"]
    assert names("Rename /srv/a.txt to /srv/b.txt") == ["move_file"]
    # a second thing asked brings a second skill; a second way of doing the first does not
    assert names("Read the file /srv/x and list the running processes") == ["list_processes", "read_file"]
    assert names("Read the file /srv/read/list_dir/x") == ["read_file"]  # the words of a path are not asked
    # everyday words count as the tools' own; a tie goes to the skill whose name the request matches more of
    assert names("Remove the folder /srv/cache") == ["delete_file"]
    assert names("Show me what is inside /srv/c.ini")[0] == "read_file"


def test_path_arguments_may_only_be_the_request_s_paths() -> None:
    assert compact.request_paths("Fetch https://h.example/f.zip to /srv/f.zip, then ~/x and/or ./y.") == [
        "/srv/f.zip", "~/x", "./y"]  # a URL's path is no path on the device; trailing punctuation is not kept
    move = next(t for t in TOOLS if t.name == "move_file")
    args = compact.narrow_arguments(move, "Move /srv/r.pdf into the folder /srv/archive")
    assert args is not None and set(args["properties"]) == {"source", "destination"}  # no `overwrite`
    source = args["properties"]["source"]["anyOf"]
    # an action may name a file the request names inside a named folder; a skill that only looks may not
    assert source[0] == {"type": "string", "enum": ["/srv/r.pdf", "/srv/archive", "/srv/archive/r.pdf"]}
    assert "$ref" in source[1]["properties"]
    assert compact.allowed_paths("Create notes.txt in /srv/docs", True) == ["/srv/docs", "/srv/docs/notes.txt"]
    listing = next(t for t in TOOLS if t.name == "list_dir")
    args = compact.narrow_arguments(listing, "List /srv/docs, hidden ones too")
    assert args is not None and args["properties"]["path"]["anyOf"][0] == {"type": "string", "enum": ["/srv/docs"]}
    assert "show_hidden" in args["properties"]  # an optional argument the request names is offered


async def test_the_compact_prompt_schema_and_checks() -> None:
    request = "Delete the file /srv/x/old.log"
    wrong = {"steps": [{"skill": "delete_file", "args": {"path": "x/old.log"}}]}
    twice = {"steps": [{"skill": "delete_file", "args": {"path": "/srv/x/old.log"}}] * 2}
    async with FakeLLM([json.dumps(wrong), json.dumps(twice)]) as fake, \
            LLMClient(fake.settings(plan_compact=True)) as llm:
        result = await plan_request(llm, request, devices={"laptop": DeviceView(tools=TOOLS)})
    # the mangled path is named in the re-ask; the step written twice runs once
    assert result.attempts == 2 and "path is 'x/old.log'" in result.first_problems[0]
    assert [(s.skill, s.args) for s in result.plan.steps] == [("delete_file", {"path": "/srv/x/old.log"})]
    first = fake.requests[0]
    system = first["messages"][0]["content"]
    assert "delete_file" in system and "shell" not in system and "Policy" not in system
    assert len(system) < 600
    schema = first["response_format"]["json_schema"]["schema"]
    [branch] = schema["properties"]["steps"]["items"]["anyOf"]
    assert branch["properties"]["skill"] == {"type": "string", "enum": ["delete_file"]}
    assert set(branch["properties"]["args"]["properties"]) == {"path"}
    # the re-ask quotes the bad reply and names the path the request wrote
    assert "/srv/x/old.log" in fake.requests[1]["messages"][-1]["content"]
