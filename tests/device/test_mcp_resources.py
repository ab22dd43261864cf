"""Resources and prompts of an external MCP server through the `mcp.*` meta tools, against the real
`@modelcontextprotocol/server-everything` (npm, installed by scripts/test): `tether exec` on this
machine as a real process, and a real server and device process."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kits.netutil import CLI, Cluster, tether_env
from tether.protocol.models import Command, ResultStatus

REPO = Path(__file__).resolve().parents[2]
EVERYTHING = REPO / ".tether-test-node" / "node_modules" / ".bin" / "mcp-server-everything"


@pytest.fixture(scope="module")
def everything_bin() -> Path:
    if shutil.which("node") is None:
        pytest.fail("node is not on PATH; install Node.js 20+ (e.g. `apt-get install nodejs npm`)")
    if not EVERYTHING.exists():
        pytest.fail(f"{EVERYTHING} is missing; install it from {REPO} with: npm install --prefix .tether-test-node "
                    "@modelcontextprotocol/server-everything")
    return EVERYTHING


def config(tmp_path: Path, binary: Path, *, down: bool = False) -> Path:
    servers: dict[str, Any] = {"everything": {"command": str(binary), "args": ["stdio"]}}
    if down:  # a server whose process exits at once: never up
        servers["down"] = {"command": shutil.which("false") or "/bin/false"}
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


def exec_json(tmp_path: Path, cfg: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    state = tmp_path / "state"
    ran = subprocess.run([*CLI, "exec", "--config", str(cfg), "--state-dir", str(state), "--json", *args],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, env=tether_env(state), timeout=120)
    assert "Traceback" not in ran.stderr, ran.stderr
    return ran.returncode, json.loads(ran.stdout), ran.stderr


def test_resources_listed_and_read(tmp_path: Path, everything_bin: Path) -> None:
    cfg = config(tmp_path, everything_bin)
    rc, listed, err = exec_json(tmp_path, cfg, "mcp.list_resources", "server=everything")
    assert rc == 0, err
    uris = {r["uri"] for r in listed["result"]["resources"]}
    assert "demo://resource/static/document/features.md" in uris
    templates = {t["uriTemplate"] for t in listed["result"]["templates"]}
    assert "demo://resource/dynamic/text/{resourceId}" in templates or any("dynamic/text" in t for t in templates)

    rc, doc, err = exec_json(tmp_path, cfg, "mcp.read_resource", "server=everything",
                             "uri=demo://resource/static/document/features.md")
    assert rc == 0, err
    assert doc["result"]["text"].startswith("# Everything Server - Features")
    assert doc["result"]["contents"][0]["mimeType"] == "text/markdown"

    rc, blob, err = exec_json(tmp_path, cfg, "mcp.read_resource", "uri=demo://resource/dynamic/blob/1")
    assert rc == 0, err  # the only external server: no server= needed
    [content] = blob["result"]["contents"]
    assert base64.b64decode(content["blob"]).startswith(b"Resource 1: This is a base64 blob")
    assert blob["result"]["text"] == ""


def test_a_resource_link_is_followed(tmp_path: Path, everything_bin: Path) -> None:
    cfg = config(tmp_path, everything_bin)
    rc, links, err = exec_json(tmp_path, cfg, "get-resource-links", "count:=2")
    assert rc == 0, err
    found = [item for item in links["result"]["content"] if item["type"] == "resource_link"]
    assert [item["server"] for item in found] == ["everything", "everything"]
    text_link = next(item for item in found if "/text/" in item["uri"])
    rc, read, err = exec_json(tmp_path, cfg, "mcp.read_resource", f"server={text_link['server']}",
                              f"uri={text_link['uri']}")
    assert rc == 0, err
    assert read["result"]["text"].startswith("Resource 2: This is a plaintext resource")


def test_prompts_listed_and_filled(tmp_path: Path, everything_bin: Path) -> None:
    cfg = config(tmp_path, everything_bin)
    rc, listed, err = exec_json(tmp_path, cfg, "mcp.list_prompts", "server=everything")
    assert rc == 0, err
    prompts = {p["name"]: p for p in listed["result"]["prompts"]}
    assert {"simple-prompt", "args-prompt"} <= prompts.keys()
    assert {a["name"]: a.get("required", False) for a in prompts["args-prompt"]["arguments"]} == {
        "city": True, "state": False}
    rc, got, err = exec_json(tmp_path, cfg, "mcp.get_prompt", "server=everything", "name=args-prompt",
                             'arguments:={"city": "Paris", "state": "Texas"}')
    assert rc == 0, err
    assert got["result"]["text"] == "What's weather in Paris, Texas?"
    assert got["result"]["messages"][0]["role"] == "user"


def test_errors_are_clear(tmp_path: Path, everything_bin: Path) -> None:
    cfg = config(tmp_path, everything_bin, down=True)
    rc, unknown, _ = exec_json(tmp_path, cfg, "mcp.read_resource", "server=nope", "uri=demo://x")
    assert rc == 1 and "unknown MCP server 'nope'" in unknown["error"] and "down, everything" in unknown["error"]
    rc, which, _ = exec_json(tmp_path, cfg, "mcp.read_resource", "uri=demo://x")
    assert rc == 1 and "give server=NAME" in which["error"]
    rc, missing, _ = exec_json(tmp_path, cfg, "mcp.read_resource", "server=everything", "uri=demo://nothing/here")
    assert rc == 1 and "demo://nothing/here" in missing["error"] and "not found" in missing["error"]
    rc, prompt, _ = exec_json(tmp_path, cfg, "mcp.get_prompt", "server=everything", "name=args-prompt")
    assert rc == 1 and "city" in prompt["error"]  # a required argument left out: the server's words
    rc, down, _ = exec_json(tmp_path, cfg, "mcp.list_prompts", "server=down")
    assert rc == 1 and "server 'down'" in down["error"] and "failed to start" in down["error"]
    rc, builtin, _ = exec_json(tmp_path, cfg, "mcp.list_resources", "server=shell")
    assert rc == 1 and "unknown MCP server 'shell'" in builtin["error"]

    small = tmp_path / "small.yaml"  # seed 003's shape: a server's max_result_bytes caps what is read too
    small.write_text(json.dumps({"mcp": {"default": {"default": {"data_collection": [{
        "namespace": "everything", "server_type": "stdio", "command": str(everything_bin), "args": ["stdio"],
        "max_result_bytes": 1024}]}}}}))
    rc, big, _ = exec_json(tmp_path, small, "mcp.read_resource", "uri=demo://resource/static/document/features.md")
    assert rc == 1 and "too large" in big["error"] and "max_result_bytes" in big["error"]
    assert big["result"]["too_large"] is True and big["result"]["limit"] == 1024


@pytest.fixture
def alpha(tmp_path: Path, everything_bin: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        proc = cluster.device("alpha", extra=("--config", str(config(tmp_path, everything_bin))))
        cluster.wait_online("alpha", proc)
        yield cluster
    finally:
        cluster.close()


def test_on_a_device_through_the_server(alpha: Cluster) -> None:
    commands = [Command(tool_name="mcp.read_resource",
                        parameters={"server": "everything", "uri": "demo://resource/dynamic/text/4"}),
                Command(tool_name="mcp.get_prompt", parameters={"server": "everything", "name": "simple-prompt"}),
                Command(tool_name="mcp.list_resources", parameters={"server": "elsewhere"})]
    _, results = alpha.remote.run("alpha", commands, timeout=60)
    assert [r.status for r in results] == [ResultStatus.SUCCESS, ResultStatus.SUCCESS, ResultStatus.FAILURE]
    assert results[0].result["text"].startswith("Resource 4: This is a plaintext resource")
    assert results[1].result["text"]
    assert "unknown MCP server 'elsewhere'" in (results[2].error or "")
