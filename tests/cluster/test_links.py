"""Direct links between nodes and the holder hint (issue 33 item 2), with real nodes, redis-server and a device.

Each node's link URL (`--set cluster_link=…`) points at a TCP proxy in front of it (tests/kits/cluster.py's
`RedisLink`, which forwards any TCP), so the test can cut every link between the nodes while Redis stays up:
- a command crossing nodes over a link is answered with its result, run once, when the link drops while it
  runs (the request is sent again through Redis; the holding node, still running it, answers once);
- the answer from a node that does not hold the device names the holding node (`X-Tether-Holder`); the
  Client (and the CLI's `RemoteServer`) sends the device's next call there, and back to its base URL when
  the hinted node is unreachable;
- a link request without the cluster secret's proof, or from a foreign page's Origin, is refused before the
  upgrade.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest
import websockets

from bench.kit.engines import Engine
from tests.cluster.test_faults import device_on, echo, gated, policy_args, until_file
from tests.kits.cluster import WAIT, ClusterKit, Node, RedisLink, free_port
from tether.client import AsyncClient
from tether.client.rest import RemoteServer
from tether.protocol.models import Command
from tether.server.cluster.link import decode_frame, encode_frame


async def linked_node(kit: ClusterKit, name: str) -> tuple[Node, RedisLink]:
    """A node whose announced link (and API) URL is a proxy in front of it."""
    port = free_port()
    proxy = await RedisLink(port).start()
    node = await kit.start_node(name, port=port,
                                extra=["--set", f"cluster_link=ws://127.0.0.1:{proxy.port}/cluster/link"])
    return node, proxy


async def test_a_dropped_link_loses_no_call_and_the_hint_is_followed(tmp_path: Path, redis_engine: Engine) -> None:
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        (a, a_proxy), (b, b_proxy) = await linked_node(kit, "a"), await linked_node(kit, "b")
        try:
            await device_on(kit, "laptop", b, [b, a], policy_args(kit))
            since = len(a.process.lines)
            first = await kit.run(a, "laptop", echo(kit, "one"))  # through Redis; a dials b meanwhile
            assert first.status_code == 200, first.text
            assert first.json()["results"][0]["status"] == "success", first.text
            assert first.headers["x-tether-holder"] == f"http://127.0.0.1:{b_proxy.port}", first.headers
            await a.process.wait_line(r"cluster link to node b open", since)

            # the Client follows the hint: its second call reaches b (through b's proxy), not a
            token = kit.admin_token
            async with AsyncClient(a.url, token) as client:
                commands = [Command.model_validate(c) for c in echo(kit, "two")]
                assert (await client.run("laptop", commands, timeout=20)).results[0].status.value == "success"
                accepted = b_proxy.accepted
                assert (await client.run("laptop", commands, timeout=20)).results[0].status.value == "success"
                assert b_proxy.accepted == accepted + 1, "the second call did not go to the node the hint named"
                with RemoteServer(a.url, token) as remote:  # the CLI's client: the same
                    for _ in range(2):
                        accepted = b_proxy.accepted
                        _, [ran] = await asyncio.to_thread(remote.run, "laptop", commands, timeout=20)
                        assert ran.status.value == "success"
                    assert b_proxy.accepted == accepted + 1, "the CLI's second call did not follow the hint"

                # a link dropped while a command crosses it: the call still gets its result, and it ran once
                command, mark, gate = gated(kit, "l1")
                call = asyncio.create_task(kit.run(a, "laptop", [command], timeout=WAIT))
                await until_file(mark, "the command runs on laptop")
                since = len(a.process.lines)
                a_proxy.cut()
                b_proxy.cut()  # every link between a and b, both ways; Redis is untouched
                await a.process.wait_line(r"request \w+ \(batch\) waited: sent again through Redis", since)
                fd = os.open(gate, os.O_RDWR)
                try:
                    os.write(fd, b"go\n")
                    async with asyncio.timeout(WAIT):
                        response = await call
                finally:
                    os.close(fd)
                assert response.status_code == 200, response.text
                [result] = response.json()["results"]
                assert result["status"] == "success", result
                assert mark.read_text() == "ran\n", "the command ran more than once"

                # the hinted node is unreachable now (its proxy is closed: connections refused): the Client
                # goes back to its base URL, node a
                await b_proxy.aclose()
                assert (await client.run("laptop", commands, timeout=20)).results[0].status.value == "success"

            # without the cluster secret's proof no link opens
            for headers in ({"X-Tether-Node": "a", "X-Tether-Time": "1", "Authorization": "Link 00"},
                            {"X-Tether-Node": "a", "X-Tether-Time": str(int(time.time())),
                             "Authorization": "Link " + "0" * 64}, {}):
                with pytest.raises(websockets.InvalidStatus) as refused:
                    async with websockets.connect(f"ws://127.0.0.1:{b.port}/cluster/link", additional_headers=headers):
                        pass
                assert refused.value.response.status_code == 403
            # the link route is served ahead of FastAPI's middleware, behind the same request guard: a foreign
            # page's Origin is refused before any proof is looked at
            with pytest.raises(websockets.InvalidStatus) as refused:
                async with websockets.connect(f"ws://127.0.0.1:{b.port}/cluster/link",
                                              additional_headers={"Origin": "http://evil.example"}):
                    pass
            assert refused.value.response.status_code == 403
            assert b"origin" in refused.value.response.body.lower(), refused.value.response.body
            health = await kit.http(b).get("/health")
            assert health.status_code == 200
        finally:
            await a_proxy.aclose()
            await b_proxy.aclose()


def test_a_cluster_link_setting_is_checked() -> None:
    from pydantic import ValidationError

    from tether.server.settings import ServerSettings

    assert ServerSettings(cluster_link="OFF").cluster_link == "off"
    with pytest.raises(ValidationError, match="ws:// or wss://"):
        ServerSettings(cluster_link="http://node2:8765")
    assert httpx.URL(ServerSettings(cluster_link="wss://n2:8765/cluster/link").cluster_link or "").scheme == "wss"


def test_link_frames_carry_every_string_json_can() -> None:
    """A frame is written by pydantic-core's encoder, which refuses a lone surrogate (JSON escapes it, and a
    device's output can hold one): such a frame is written and read as `json` does, not refused, which
    would close the link."""
    lone = json.loads('"\\udc80 out"')
    for messages in ([{"t": "part", "rid": "r1", "body": {"event": {"data": lone}}}],
                     [{"t": "done", "rid": "r2", "body": {"results": "[]", "text": "é ✓ 😀", "n": [1, 2.5, None]}}]):
        frame = encode_frame(messages)
        assert decode_frame(frame) == messages
        assert decode_frame(frame.decode()) == messages
    with pytest.raises(ValueError):
        decode_frame("[{not json")
