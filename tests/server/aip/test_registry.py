"""Device selection by requirements and least load, and the error that says why nothing fits."""

from __future__ import annotations

import asyncio

import pytest

from tether.protocol.models import ToolInfo
from tether.protocol.profile import DeviceProfile, DeviceRequirements
from tether.server.aip.fleet.matching import NoDeviceError
from tether.server.aip.fleet.registry import DeviceRegistry


def profile(platform: str, *, gpu: bool = False, tags: tuple[str, ...] = (), tools: tuple[str, ...] = ()
            ) -> DeviceProfile:
    return DeviceProfile.model_validate({
        "os": {"platform": platform}, "gpu": {"available": gpu}, "tags": list(tags),
        "tools": [ToolInfo(name=t.split("/")[-1], namespace=t.split("/")[0] if "/" in t else "builtin",
                           tool_type="action").model_dump() for t in tools]})


@pytest.fixture
def registry() -> DeviceRegistry:
    reg = DeviceRegistry()
    fleet = {
        "desktop": (profile("Windows", gpu=True, tags=("office",), tools=("excel/open",)), 2),
        "laptop": (profile("linux", tags=("lab", "mobile"), tools=("shell.run", "screen/capture")), 0),
        "rig": (profile("linux", gpu=True, tags=("lab",), tools=("shell.run",)), 1),
        "spare": (profile("linux", gpu=True, tags=("lab",), tools=("shell.run",)), 1),
    }
    for name, (prof, load) in fleet.items():
        record = reg.ensure(name)
        record.profile, record.connected, record.inflight = prof, True, load
    old = reg.ensure("box")
    old.profile = profile("linux", gpu=True)  # known, but offline
    return reg


@pytest.mark.parametrize("requirements, chosen", [
    ({}, "laptop"),  # least load
    ({"gpu": True}, "rig"),  # rig and spare tie on load 1: by name
    ({"platform": "LINUX", "tags": ["lab"]}, "laptop"),
    ({"platform": "windows"}, "desktop"),
    ({"tools": ["shell.run"], "gpu": True}, "rig"),
    ({"tools": ["screen/capture"]}, "laptop"),  # qualified namespace/name
    ({"tools": ["capture"]}, "laptop"),  # bare name
    ({"gpu": False, "platform": "linux"}, "laptop"),
    ({"name": "spare"}, "spare"),
    ({"tags": ["office"]}, "desktop"),
])
def test_selection(registry, requirements, chosen):
    assert registry.select(DeviceRequirements(**requirements)).name == chosen


def test_load_decides_and_running_counts(registry):
    registry.get("laptop").running = 5  # the device says it is busier than the server knows
    assert registry.get("laptop").load == 5 and registry.get("laptop").status == "busy"
    assert registry.select(DeviceRequirements(tags=["lab"])).name == "rig"


@pytest.mark.parametrize("requirements, message", [
    ({"gpu": True, "tags": ["mobile"]},
     'no device fits {tags: ["mobile"], gpu: true}: box is offline; desktop lacks tag(s) mobile; '
     "laptop has no GPU; rig lacks tag(s) mobile; spare lacks tag(s) mobile"),
    ({"platform": "darwin", "name": "laptop"},
     'no device fits {name: "laptop", platform: "darwin"}: laptop runs linux, not darwin'),
    ({"name": "box"}, 'no device fits {name: "box"}: box is offline'),
    ({"name": "ghost"}, 'no device fits {name: "ghost"}: no device named ghost has registered'),
    ({"tools": ["browser.act"], "platform": "linux"},
     'no device fits {platform: "linux", tools: ["browser.act"]}: box is offline; desktop runs Windows, not linux; '
     "laptop lacks tool(s) browser.act; rig lacks tool(s) browser.act; spare lacks tool(s) browser.act"),
])
def test_no_device_fits_says_why_for_each(registry, requirements, message):
    with pytest.raises(NoDeviceError) as caught:
        registry.select(DeviceRequirements(**requirements))
    assert str(caught.value) == message
    assert set(caught.value.reasons) <= {"box", "desktop", "laptop", "rig", "spare"}


def test_empty_registry_and_offline_status():
    reg = DeviceRegistry()
    with pytest.raises(NoDeviceError, match="no device has registered"):
        reg.select()
    record = reg.ensure("x")
    assert record.status == "offline" and record.summary()["status"] == "offline"


async def test_wait_until_wakes_on_notify():
    reg = DeviceRegistry()
    record = reg.ensure("x")

    async def connect_later() -> None:
        record.connected = True
        reg.notify()

    task = asyncio.create_task(connect_later())
    assert await reg.wait_until(lambda: record.status == "online", 5)
    await task
    assert not await reg.wait_until(lambda: record.status == "busy", 0.01)
