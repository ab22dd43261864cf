"""`run_on_fleet` on the gateway: one call on every device meeting requirements (the fan-out engine of
POST /api/v1/fleet/commands), each device's outcome as progress, scopes, bad input, and a device that
fails; driven by the official SDK client against scripted devices over real AIP sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.kits.gateway import GatewayServer, mcp_client, register
from tether.protocol.models import Result


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[GatewayServer]:
    running = await GatewayServer(tmp_path).start()
    yield running
    await running.stop()


async def test_one_call_on_every_matching_device_with_progress(server: GatewayServer) -> None:
    devices = {name: await register(server, name) for name in ("a1", "a2", "b1")}
    served = [devices["a1"].serve_forever(), devices["b1"].serve_forever(),
              devices["a2"].serve_forever(lambda c: Result.failure("exit code 1", c.call_id, "shell"))]
    progress: list[tuple[float, float | None, str | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, total, message))

    async with mcp_client(server.mcp_url, server.token("ops", "execute")) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        assert listed["run_on_fleet"].output_schema is not None
        result = await client.call_tool("run_on_fleet", {"tool": "shell.run", "arguments": {"cmd": "true"},
                                                         "requires": {}},
                                        progress_callback=on_progress)
        assert result.is_error  # one device failed: the call says so, with every device's line
        summary = result.structured_content["summary"]
        assert (summary["ok"], summary["failed"], summary["total"]) == (2, 1, 3)
        statuses = {line["device"]: line["status"] for line in result.structured_content["devices"]}
        assert statuses == {"a1": "ok", "a2": "failed", "b1": "ok"}
        assert sorted(p[0] for p in progress) == [1, 2, 3] and all(p[1] == 3 for p in progress)
        assert any(p[2] and p[2].startswith("a2: failed") for p in progress)

        only_b = await client.call_tool("run_on_fleet", {"tool": "shell.run", "requires": {"name": "b1"}})
        assert not only_b.is_error and only_b.structured_content["summary"]["total"] == 1

        nobody = await client.call_tool("run_on_fleet", {"tool": "shell.run", "requires": {"platform": "plan9"}})
        assert nobody.is_error and "run_on_fleet" in nobody.content[0].text
        bad = await client.call_tool("run_on_fleet", {"tool": "shell.run", "requires": {"colour": "red"}})
        assert bad.is_error and "colour" in bad.content[0].text

    async with mcp_client(server.mcp_url, server.token("viewer", "read")) as reader:
        refused = await reader.call_tool("run_on_fleet", {"tool": "shell.run"})
        assert refused.is_error and "execute" in refused.content[0].text
    rows = server.store.audit.rows(token="ops")
    assert len(rows) == 4 and all(r["requested_by"] == "mcp:mcp/0.1.0 by api:ops" for r in rows)
    for task in served:
        task.cancel()
    for device in devices.values():
        await device.close()
