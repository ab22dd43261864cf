"""The device registry at fleet size (issue 13): shared tool lists, the paged and filtered device list,
start-up with many known devices.

Registry-level checks compare every page walk with a brute-force filter over a seeded random fleet;
the rest runs the real server (the whole app under uvicorn on 127.0.0.1, or the hub with scripted AIP
devices from aip_testkit) against a real SQLite store.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import socket
import sqlite3
from collections.abc import AsyncIterator
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.kits.aip import WAIT, ServerFactory
from tether.protocol.messages import ClientMessage, ClientMessageType, ServerMessageType, TaskStatus
from tether.protocol.models import ToolInfo
from tether.protocol.profile import DeviceProfile
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.hub import DeviceHub
from tether.server.http.app import create_app
from tether.server.settings import ServerSettings
from tether.server.store import Store
from tether.server.store.engine import pick
from tether.server.store.migrations import MIGRATIONS

PLATFORMS = ("linux", "Windows", "darwin", None)
TAGS = ("lab", "gpu", "office", "edge", "eu")


def tools(*names: str, flavour: str = "") -> list[dict[str, Any]]:
    return [ToolInfo(name=n, namespace="builtin", tool_type="action", description=f"{n} {flavour}".strip(),
                     input_schema={"type": "object", "properties": {"path": {"type": "string"}},
                                   "required": ["path"]}).model_dump() for n in names]


def profile(platform: str | None = "linux", tags: tuple[str, ...] = (), tool_list: list[dict[str, Any]] | None = None,
            **extra: Any) -> DeviceProfile:
    """A fresh model each call: interning must recognise equal content, not the same object."""
    return DeviceProfile.model_validate({"os": {"platform": platform}, "tags": list(tags),
                                         "tools": tool_list if tool_list is not None else tools("a", "b"), **extra})


def random_fleet(seed: int, size: int) -> DeviceRegistry:
    rng = random.Random(seed)
    registry = DeviceRegistry()
    for i in range(size):
        record = registry.ensure(f"{rng.choice(['lab', 'edge', 'desk'])}-{i:04d}")
        if rng.random() < 0.9:
            record.profile = profile(rng.choice(PLATFORMS), tuple(rng.sample(TAGS, rng.randint(0, 3))))
        record.connected = rng.random() < 0.7
        record.inflight = rng.choice((0, 0, 1)) if record.connected else 0
    return registry


def brute(registry: DeviceRegistry, status: str | None, platform: str | None, tags: tuple[str, ...],
          name: str | None) -> list[str]:
    return [r.name for r in registry.list()
            if (status is None or r.status == status)
            and (platform is None or (r.platform or "").lower() == platform.lower())
            and set(tags) <= set(r.tags) and (name is None or fnmatchcase(r.name, name))]


def walk(registry: DeviceRegistry, limit: int, **filters: Any) -> list[str]:
    names: list[str] = []
    after = None
    for _ in range(10_000):
        page, after = registry.page(limit=limit, after=after, **filters)
        assert len(page) <= limit
        names += [r.name for r in page]
        if after is None:
            return names
        assert page and after == page[-1].name
    raise AssertionError("the page walk did not end")


@pytest.mark.parametrize("status", [None, "online", "busy", "offline"])
@pytest.mark.parametrize("platform, tags, name", [
    (None, (), None), ("LINUX", (), None), (None, ("lab",), None), ("windows", ("lab", "eu"), None),
    (None, (), "lab-*"), ("linux", ("gpu",), "*-00?[0-5]"), (None, ("nosuch",), None), ("plan9", (), None),
    (None, (), "desk-0042"),
])
def test_every_page_walk_equals_the_filtered_list(status, platform, tags, name):
    registry = random_fleet(7, 400)
    expected = brute(registry, status, platform, tags, name)
    for limit in (1, 7, 1000):
        assert walk(registry, limit, status=status, platform=platform, tags=tags, name=name) == expected
    everything, after = registry.page(status=status, platform=platform, tags=tags, name=name)
    assert [r.name for r in everything] == expected and after is None


def test_a_cursor_is_stable_while_devices_join_leave_and_change_between_pages():
    registry = random_fleet(11, 300)
    first, cursor = registry.page(status="online", limit=50)
    assert cursor == first[-1].name
    seen = {r.name for r in first}
    # between pages: devices join on both sides of the cursor, some leave, some change
    registry.ensure("aaa-before").connected = True
    registry.ensure("zzz-after").connected = True
    later = [r for r in registry.list() if r.name > cursor]
    registry.forget(later[0].name)
    later[1].connected = False
    later[2].connected = True
    earlier = [r for r in registry.list() if r.name < cursor]
    earlier[0].connected = False
    rest = walk_from(registry, cursor, status="online")
    assert not seen & set(rest), "a device was listed twice"
    assert rest == [n for n in brute(registry, "online", None, (), None) if n > cursor]
    assert "zzz-after" in rest and "aaa-before" not in rest and later[0].name not in rest


def walk_from(registry: DeviceRegistry, after: str, **filters: Any) -> list[str]:
    names: list[str] = []
    cursor: str | None = after
    while cursor is not None:
        page, cursor = registry.page(limit=13, after=cursor, **filters)
        names += [r.name for r in page]
    return names


def test_indexes_follow_profile_changes_and_forgetting():
    registry = DeviceRegistry()
    record = registry.ensure("box")
    record.profile = profile("linux", ("lab", "eu"))
    assert [r.name for r in registry.page(tags=("eu",))[0]] == ["box"]
    record.profile = profile("darwin", ("office",))
    assert registry.page(tags=("eu",))[0] == [] and registry.page(platform="linux")[0] == []
    assert [r.name for r in registry.page(platform="DARWIN", tags=("office",))[0]] == ["box"]
    record.profile = None
    assert registry.page(platform="darwin")[0] == [] and record.platform is None and record.tags == ()
    registry.forget("box")
    assert registry.get("box") is None and registry.page()[0] == [] and len(registry) == 0


def test_equal_tool_lists_are_one_shared_list_freed_with_its_last_holder():
    registry = DeviceRegistry()
    a, b, c = (registry.ensure(n) for n in ("a", "b", "c"))
    a.profile, b.profile = profile(tool_list=tools("x", "y")), profile(tool_list=tools("x", "y"))
    c.profile = profile(tool_list=tools("x", "z"))
    assert a.profile.tools is b.profile.tools and a.tools_digest == b.tools_digest
    assert a.profile.os is b.profile.os is c.profile.os and a.profile.cpu is c.profile.cpu  # equal sections shared
    a.profile = profile("darwin", tool_list=tools("x", "y"))
    assert a.profile.os.platform == "darwin" and b.profile.os.platform == "linux" and a.profile.os is not b.profile.os
    assert [t.model_dump() for t in a.profile.tools] == tools("x", "y")  # equal to what each device sent
    assert c.profile.tools is not a.profile.tools and len(registry.tools) == 2
    assert registry.tools.holders(a.tools_digest) == 2
    shared = a.tools_digest
    # a profile update replaces the device's tools; the old list stays while another device holds it
    a.profile = profile(tool_list=tools("x", "z"))
    assert a.profile.tools is c.profile.tools and [t.name for t in a.profile.tools] == ["x", "z"]
    assert registry.tools.get(shared) is b.profile.tools and registry.tools.holders(shared) == 1
    registry.forget("b")
    assert registry.tools.get(shared) is None and len(registry.tools) == 1
    c.profile = profile(tool_list=tools("x", "z"))  # same content again: still one list, same holders
    assert len(registry.tools) == 1 and registry.tools.holders(c.tools_digest) == 2


def test_equal_lists_of_names_and_fields_sets_are_shared_and_stay_each_devices_own():
    registry = DeviceRegistry()
    apps = ["git", "python3", "chromium"]
    a, b, c = (registry.ensure(n) for n in ("a", "b", "c"))
    a.profile = profile(tags=("lab", "eu"), installed_apps=list(apps), home="/home/u")
    b.profile = profile(tags=("lab", "eu"), installed_apps=list(apps), home="/home/u")
    c.profile = profile(tags=("lab",), installed_apps=[*apps, "docker"])
    assert a.profile.installed_apps is b.profile.installed_apps and a.profile.tags is b.profile.tags
    assert a.profile.model_fields_set is b.profile.model_fields_set
    assert c.profile.tags == ["lab"] and c.profile.installed_apps == [*apps, "docker"]
    assert c.profile.installed_apps is not a.profile.installed_apps
    assert c.profile.model_fields_set != a.profile.model_fields_set  # c has no home: its own set
    # what each device sent, dumped and indexed as before
    assert a.profile.model_dump()["installed_apps"] == apps and "home" not in c.profile.model_dump(exclude_unset=True)
    assert sorted(r.name for r in registry.page(tags=("eu",))[0]) == ["a", "b"]
    # a device's new profile replaces its lists; the others keep theirs
    a.profile = profile(tags=("office",), installed_apps=["vim"])
    assert a.profile.tags == ["office"] and b.profile.tags == ["lab", "eu"] and b.profile.installed_apps == apps
    assert [r.name for r in registry.page(tags=("office",))[0]] == ["a"]
    # held weakly: gone with the last profile holding them
    registry.forget("b")
    registry.forget("c")
    gc.collect()
    assert ("tags", "lab", "eu") not in registry._lists and ("installed_apps", *apps) not in registry._lists


# -- the real server -------------------------------------------------------------------------------


@pytest.fixture
async def servers(tmp_path):
    factory = ServerFactory(tmp_path)
    yield factory
    await factory.stop_all()


async def test_registered_devices_share_tools_and_a_device_info_replaces_them(servers):
    srv = await servers.start(max_frame_bytes=1 << 20)
    many = tools(*(f"tool{i}" for i in range(14)), flavour="realistic")
    devices = [srv.device(f"dev{i}", profile=profile("linux", ("lab",), many)) for i in range(3)]
    for device in devices:
        assert (await device.register()).type is ServerMessageType.REGISTER_ACK
    records = [srv.hub.registry.get(f"dev{i}") for i in range(3)]
    assert records[0].profile.tools is records[1].profile.tools is records[2].profile.tools
    assert len(srv.hub.registry.tools) == 1 and srv.hub.registry.tools.holders(records[0].tools_digest) == 3
    old = records[0].tools_digest
    new = profile("linux", ("lab", "gpu"), tools("only"))
    await devices[0].send(ClientMessage(type=ClientMessageType.DEVICE_INFO, payload=new.model_dump()))
    await devices[0].sync()
    assert [t.name for t in records[0].profile.tools] == ["only"] and records[0].tags == ("lab", "gpu")
    assert srv.hub.registry.tools.holders(old) == 2
    # the store holds each distinct list once, and the device's current one
    # read after the device rows written behind the caller (with PostgreSQL): in order on the pool
    stored = {d.name: d.profile for d in await srv.store.call(srv.store.devices.all, in_order=True)}
    assert [t["name"] for t in stored["dev0"]["tools"]] == ["only"] and len(stored["dev1"]["tools"]) == 14
    assert srv.store._engine.read("SELECT COUNT(*) FROM device_tools")[0][0] == 2


async def test_a_heartbeat_answer_is_a_complete_frame_with_its_own_id(servers):
    srv = await servers.start()
    device = srv.device("beater")
    await device.register()
    answers = []
    for _ in range(3):
        await device.send(ClientMessage(type=ClientMessageType.HEARTBEAT, payload={"running": 0}))
        answers.append(await device.recv())
    assert all(a.type is ServerMessageType.HEARTBEAT and a.status is TaskStatus.OK for a in answers)
    assert len({a.response_id for a in answers}) == 3 and all(a.timestamp for a in answers)


def _prefill(store: Store, count: int, *, legacy: int = 0) -> list[dict[str, Any]]:
    """`count` known devices as the hub stores them; the first `legacy` the way older servers did
    (the whole profile, tools inline, no digest)."""
    registry = DeviceRegistry()
    profiles = []
    for i in range(count):
        prof = profile(PLATFORMS[i % 3], (TAGS[i % 5],), tools("r", "w", flavour=str(i % 4)), home=f"/home/u{i}")
        profiles.append(prof.model_dump(mode="json"))
        if i < legacy:
            store.devices.upsert(f"known-{i:05d}", prof.model_dump_json(), 1000.0 + i)
            continue
        record = registry.ensure(f"known-{i:05d}")
        record.profile = prof
        store.devices.upsert(record.name, prof.model_dump_json(exclude={"tools"}), 1000.0 + i,
                            tools=(record.tools_digest, registry.tools.dump(prof.tools)))
    return profiles


async def test_start_lists_known_devices_without_reading_profiles_and_reads_one_when_asked(tmp_path):
    store = Store(tmp_path / "server.db")
    profiles = _prefill(store, 300, legacy=20)
    hub = DeviceHub(store, ServerSettings(db_path=tmp_path / "server.db"))
    await hub.start()
    try:
        registry = hub.registry
        assert len(registry) == 300 and len(registry.tools) == 0  # nothing parsed yet
        page, after = registry.page(platform="windows", tags=("gpu",), limit=5)
        assert [r.name for r in page] == ["known-00001", "known-00016", "known-00031", "known-00046",
                                          "known-00061"] and after == "known-00061"
        assert all(r.status == "offline" and r.last_seen == 1000.0 + int(r.name[-5:]) for r in page)
        for i in (3, 250):  # a legacy row and a current one read back equal to what was stored
            record = registry.get(f"known-{i:05d}")
            assert record.profile.model_dump(mode="json") == profiles[i]
        assert len(registry.tools) == 2  # flavours 3 and 250 % 4 == 2
        assert registry.get("known-00007").profile.tools is registry.get("known-00011").profile.tools
    finally:
        await hub.aclose()
        store.close()


async def test_a_known_device_reconnecting_gets_its_new_profile(servers):
    srv = await servers.start(max_frame_bytes=1 << 20)
    _prefill(srv.store, 30)
    await srv.hub.aclose()  # restart the hub over the filled store
    srv.hub.__init__(srv.store, srv.hub.settings)
    await srv.hub.start()
    device = srv.device("known-00004", profile=profile("plan9", ("new",), tools("fresh")))
    assert (await device.register()).type is ServerMessageType.REGISTER_ACK
    record = srv.hub.registry.get("known-00004")
    assert record.status == "online" and record.platform == "plan9" and [t.name for t in record.profile.tools] == [
        "fresh"]
    assert [r.name for r in srv.hub.registry.page(tags=("new",))[0]] == ["known-00004"]
    assert "known-00004" not in [r.name for r in srv.hub.registry.page(platform="linux", limit=100)[0]]


async def test_an_older_database_gets_platforms_and_tags_from_its_stored_profiles(tmp_path):
    sqlite_texts = [pick(m, "sqlite") for m in MIGRATIONS]
    mine = next(i for i, m in enumerate(sqlite_texts) if "device_tools" in m)
    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for version, migration in enumerate(sqlite_texts[:mine], start=1):
        for statement in migration.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute("INSERT INTO schema_version VALUES (?)", (version,))
    conn.execute("INSERT INTO devices (name, profile, first_seen, last_seen) VALUES (?, ?, 1, 2)",
                 ("old", profile("linux", ("lab",)).model_dump_json()))
    conn.execute("INSERT INTO devices (name, profile, first_seen, last_seen) VALUES ('bare', NULL, 1, 2)")
    conn.commit()
    conn.close()
    store = Store(db)
    try:
        assert store.devices.heads() == [("bare", 2, None, [], False), ("old", 2, "linux", ["lab"], True)]
        registry = DeviceRegistry()
        registry.profile_loader = store.devices.profile
        for head in store.devices.heads():
            registry.known(*head)
        assert await registry.preload() == 1  # "old"; "bare" has no stored profile to read
        assert await registry.preload() == 0
        assert [t.name for t in registry.get("old").profile.tools] == ["a", "b"]
        assert registry.get("bare").profile is None
    finally:
        store.close()


# -- the REST list, through the whole app -------------------------------------------------------


class App:
    def __init__(self, store: Store, server: uvicorn.Server, task: asyncio.Task, port: int) -> None:
        self.store, self.server, self.task, self.port = store, server, task, port
        self.url = f"http://127.0.0.1:{port}"
        self.reader = store.tokens.create("api", "reader", ["read"])[1]

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {self.reader}"},
                                 timeout=WAIT * 4)

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 15)


async def serve(db: Path) -> App:
    store = Store(db)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # requests wait in the backlog until the lifespan has started the hub
    server = uvicorn.Server(uvicorn.Config(create_app(ServerSettings(db_path=db), store), lifespan="on",
                                           log_config=None, log_level="warning", ws_ping_interval=None))
    return App(store, server, asyncio.create_task(server.serve(sockets=[sock])), sock.getsockname()[1])


@pytest.fixture
async def filled(tmp_path: Path) -> AsyncIterator[App]:
    """A server restarted over a database that knows 2,000 devices."""
    db = tmp_path / "server.db"
    seed = Store(db)
    _prefill(seed, 2000, legacy=100)
    seed.close()
    app = await serve(db)
    yield app
    if not app.task.done():
        await app.stop()


async def test_restart_with_many_known_devices_answers_health_and_pages_through_them(filled: App):
    async with filled.http() as http:
        health = await http.get("/api/v1/health")
        assert health.status_code == 200 and health.json()["devices_online"] == 0
        names: list[str] = []
        url: str | None = "/api/v1/devices?limit=300&status=offline"
        while url is not None:
            answer = await http.get(url)
            assert answer.status_code == 200, answer.text
            rows = answer.json()
            assert len(rows) <= 300 and all(r["status"] == "offline" for r in rows)
            names += [r["name"] for r in rows]
            link = answer.headers.get("link")
            url = link[1:link.index(">")] if link else None
            assert link is None or link.endswith('>; rel="next"')
        assert names == [f"known-{i:05d}" for i in range(2000)]
        plain = (await http.get("/api/v1/devices")).json()  # no limit: the whole list, as before
        assert len(plain) == 2000 and "link" not in (await http.get("/api/v1/devices?limit=2000")).headers
        assert plain[5] == {"name": "known-00005", "status": "offline", "platform": "darwin", "last_seen": 1005.0,
                            "load": 0, "running": 0, "queued": 0, "capabilities": [], "tags": ["lab"],
                            "gpu": False, "address": None, "sandbox": None, "node": None}
        tools_now = (await http.get("/api/v1/devices/known-01999/tools")).json()
        assert [t["name"] for t in tools_now] == ["r", "w"] and tools_now[0]["description"] == "r 3"


async def test_device_list_filters_and_refusals_over_http(filled: App):
    async with filled.http() as http:
        rows = (await http.get("/api/v1/devices", params={"platform": "WINDOWS", "tag": "lab",
                                                          "name": "known-000*"})).json()
        assert [r["name"] for r in rows] == [f"known-{i:05d}" for i in range(100) if i % 3 == 1 and i % 5 == 0]
        assert rows and all(r["platform"] == "Windows" and r["tags"] == ["lab"] for r in rows)
        both = await http.get("/api/v1/devices", params=[("tag", "lab"), ("tag", "gpu")])
        assert both.json() == []
        first = await http.get("/api/v1/devices", params={"limit": 3, "name": "known-0199?"})
        assert [r["name"] for r in first.json()] == ["known-01990", "known-01991", "known-01992"]
        assert first.headers["link"] == '</api/v1/devices?limit=3&name=known-0199%3F&cursor=known-01992>; rel="next"'
        for params, words in [({"status": "asleep"}, "status"), ({"limit": 0}, "limit"), ({"limit": 5000}, "limit"),
                              ({"tag": [str(i) for i in range(40)]}, "32 tag"), ({"name": "x" * 300}, "name")]:
            answer = await http.get("/api/v1/devices", params=params)
            assert answer.status_code == 422 and words in answer.json()["error"], (params, answer.text)
        anonymous = await httpx.AsyncClient(base_url=filled.url).get("/api/v1/devices?limit=1")
        assert anonymous.status_code == 401 and set(anonymous.json()) == {"error"}


def test_stored_profile_json_is_compact(tmp_path):
    """The devices table holds no tool list of a device stored the current way."""
    store = Store(tmp_path / "s.db")
    _prefill(store, 10)
    try:
        for (text,) in store._engine.read("SELECT profile FROM devices"):
            assert "tools" not in json.loads(text)
    finally:
        store.close()


# -- the benchmark at its smallest ----------------------------------------------------------------


async def test_bench_fleet_devices_rows_have_their_anchors(capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    repo = str(Path(__file__).resolve().parents[3])
    if repo not in sys.path:  # `bench` lives at the repo root, beside tests/
        sys.path.insert(0, repo)
    from bench import fleet_devices

    rows = await fleet_devices.measure(devices=120, connected=12, per_process=6, repeats=1)
    assert [row["figure"] for row in rows] == [
        "server start with 120 known devices: /health", "server memory per idle device (12 registered)",
        "GET /api/v1/devices?limit=100, 120 devices", "GET /api/v1/devices (no limit), 120 devices"]
    for row in rows:  # memory is an RSS difference: at 12 devices its sign is noise, so only times must be > 0
        assert isinstance(row["measured"], float) and (row["unit"] == "KiB" or row["measured"] > 0), row
        anchor = row["anchor"]
        assert isinstance(anchor, float) and (not anchor or row["ratio"] == row["measured"] / anchor), row
    assert "tools" in capsys.readouterr().out
