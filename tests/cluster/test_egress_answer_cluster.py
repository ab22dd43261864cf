"""A person's answer to a device's network question (`ask: on-miss`), given on a node that does not hold the
device: the node holding it checks the answerer again, records the answer, and only then hands it to its
device — one audit row, with who gave it, whichever node was asked.

Real nodes (`tether server` processes) sharing one database and one real redis-server, a real `tether device`
whose policy asks on a miss, `curl` inside its sandbox reaching a loopback HTTP server by a name its list
does not hold.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from bench.kit.engines import Engine
from tests.kits.cluster import ClusterKit
from tests.kits.sse import async_sse_events
from tests.kits.upstream import upstream

BODY = b"hello across nodes\n"


async def test_an_answer_given_on_another_node_is_recorded_once_before_the_device_acts(
        tmp_path: Path, redis_engine: Engine) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.fail("curl is not installed; install it with: apt-get install -y curl")
    policy = tmp_path / "policy.yaml"
    policy.write_text(json.dumps({"commands": {"curl": {}}, "read_roots": [str(tmp_path)],
                                  "write_roots": [str(tmp_path)],
                                  "network": {"allow": ["127.0.0.0/8"], "ask": "on-miss"}}))
    with upstream(BODY) as port:
        url = f"http://localhost:{port}/"
        async with ClusterKit(tmp_path, redis=redis_engine) as kit:
            a, b = [await kit.start_node(name) for name in ("a", "b")]
            device = await kit.start_device("alpha", [a, b], extra=["--policy", str(policy)])
            assert await device.registered() is a
            bob = await kit.token("api", "bob", ["read", "execute", "approve"])
            auth = {"Authorization": f"Bearer {bob}"}
            body = {"commands": [{"tool_name": "shell.run", "parameters": {
                "cmd": curl, "argv": ["-sS", "--max-time", "120", url], "cwd": str(tmp_path),
                "timeoutMs": 60_000}}], "timeout": 120}
            asked: list[dict[str, Any]] = []
            result: dict[str, Any] = {}
            http = kit.http(b)
            async with http.stream("POST", "/devices/alpha/commands", json=body,
                                   headers={**auth, "Accept": "text/event-stream"}) as response:
                assert response.status_code == 200, await response.aread()
                async for kind, event in async_sse_events(response.aiter_lines()):
                    if kind == "event" and event["kind"] == "elicitation" and "id" in event["data"]:
                        asked.append(event["data"])
                        answered = await http.post(f"/devices/alpha/questions/{event['data']['id']}",
                                                   json={"action": "accept", "content": {"answer": "once"}},
                                                   headers=auth)
                        assert answered.status_code == 200, answered.text
                    elif kind == "results":
                        [result] = event["results"]
                        break
            assert len(asked) == 1 and (result.get("result") or {}).get("stdout") == BODY.decode(), result
            rows = (await http.get("/audit", params={"device": "alpha", "limit": 200})).json()["rows"]
            network = [r for r in rows if str(r["tool_name"]).startswith("network.")]
            assert len(network) == 1, network  # recorded once, by the node that handed the answer over
            assert network[0]["tool_name"] == "network.ask" and network[0]["requested_by"] == "api:bob", network
