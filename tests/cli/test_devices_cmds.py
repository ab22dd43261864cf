"""`tether devices NAME` and `tether devices rm NAME` (docs/fleet.md): the real CLI process against a real
server on 127.0.0.1 with scripted devices; `exec --all` after a removal exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tests.kits.aip import WAIT
from tests.kits.fanout import App, running_app
from tether.cli.views.device_detail import detail_grid, detail_lines
from tether.cli.views.safe_text import SafeConsole
from tether.protocol.models import Command, Result, ResultStatus

CLI = [sys.executable, "-m", "tether.cli"]


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[App]:
    async with running_app(tmp_path) as running:
        yield running


async def tether(app: App, token: str, *args: str) -> tuple[int, str, str]:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "80", "TETHER_SERVER": app.url, "TETHER_TOKEN": token}
    proc = await asyncio.create_subprocess_exec(*CLI, *args, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_detail_view_fits_80_columns(app: App) -> None:
    await app.device("laptop-of-someone", ["lab", "gpu-box"])
    code, out, err = await tether(app, app.reader, "devices", "laptop-of-someone")
    assert code == 0, (out, err)
    assert "Traceback" not in out + err
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), out
    labels = [line.split()[0] for line in lines if line.strip() and not line.startswith(" ")]
    for label in ("name", "status", "last", "platform", "cpu", "memory", "tools", "tags", "key"):
        assert label in labels, out
    assert "laptop-of-someone" in out and "lab, gpu-box" in out and "online" in out
    enrolled = app.store.device_keys.get("laptop-of-someone")
    assert enrolled is not None
    from tether.protocol.identity import fingerprint
    assert fingerprint(enrolled.public_key) in out.replace("\n", "").replace(" ", "")
    code, out, _ = await tether(app, app.reader, "devices", "show", "laptop-of-someone", "--json")
    assert code == 0 and json.loads(out)["key"]["fingerprint"] == fingerprint(enrolled.public_key)
    code, out, err = await tether(app, app.reader, "devices", "nobody")
    assert code == 1 and "no device named 'nobody'" in err and "Traceback" not in err


def test_detail_grid_folds_long_values_at_80_columns() -> None:
    device = {"name": "d" * 60, "status": "offline", "tags": [f"tag{i}" for i in range(30)], "profile": None}
    out = SafeConsole(width=80, record=True, highlight=False)
    out.print(detail_grid(detail_lines(device, {"fingerprint": "f" * 64, "enrolled_at": 1.0, "enrolled_by": "x"})))
    text = out.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "d" * 60 in text


async def test_rm_then_exec_all_exits_0(app: App) -> None:
    serving = (await app.device("keep")).serve_forever()
    gone = await app.device("old")
    await gone.close()
    assert await app.hub.registry.wait_until(lambda: not app.hub.connected("old"), WAIT)
    code, out, err = await tether(app, app.runner, "exec", "--all", "noop", "n:=1")
    assert code == 1, (out, err)  # the offline device counts while it is known
    boss = app.store.tokens.create("api", "boss", ["admin"])[1]
    code, out, err = await tether(app, boss, "devices", "rm", "old")
    assert code == 0, (out, err)
    assert "removed device old" in out
    code, out, err = await tether(app, app.runner, "exec", "--all", "noop", "n:=1")
    assert code == 0, (out, err)
    code, out, _ = await tether(app, boss, "devices", "--json")
    assert [d["name"] for d in json.loads(out)] == ["keep"]
    serving.cancel()


async def test_rm_refused_for_a_scoped_or_agent_token(app: App) -> None:
    await app.device("lab1")
    scoped = app.store.tokens.create("api", "scoped", ["admin"], devices=["other"])[1]
    agent = app.store.tokens.create("api", "bot", ["read", "execute"], agent=True)[1]
    for token in (scoped, agent, app.runner):
        code, out, err = await tether(app, token, "devices", "rm", "lab1")
        assert code != 0 and err.startswith("error:") and "Traceback" not in err, (out, err)
    assert app.hub.registry.get("lab1") is not None


def shell(text: str) -> Callable[[Command], Result]:
    """A device's answer to every command: a shell result whose stdout is `text`."""

    def answer(command: Command) -> Result:
        return Result(status=ResultStatus.SUCCESS, result={"stdout": text, "exit_code": 0}, call_id=command.call_id)

    return answer


async def test_exec_all_shows_each_output_identical_ones_folded(app: App) -> None:
    serving = [(await app.device(n)).serve_forever(shell("same\nlines\n")) for n in ("a1", "a2", "a3")]
    serving.append((await app.device("b1")).serve_forever(shell("other\n")))
    code, out, err = await tether(app, app.runner, "exec", "--all", "noop", "n:=1")
    assert code == 0, (out, err)
    lines = out.splitlines()
    assert "ok (3): a1, a2, a3" in lines and "ok (1): b1" in lines, out
    block = lines.index("ok (3): a1, a2, a3")
    assert lines[block + 1:block + 3] == ["  same", "  lines"]
    assert lines[lines.index("ok (1): b1") + 1] == "  other"
    assert out.count("same") == 1
    for task in serving:
        task.cancel()


def test_fold_header_fits_the_width() -> None:
    from tether.cli.views.fanout import fold_header

    names = [f"device-{i:03d}" for i in range(40)]
    header = fold_header(names, 80)
    assert len(header) <= 80 and header.startswith("ok (40): device-000, ") and header.endswith("more")
    assert fold_header(["a"], 80) == "ok (1): a"


async def test_rename_and_tag_round_trip(app: App) -> None:
    dev = await app.device("old", ["own"])
    boss = app.store.tokens.create("api", "boss", ["admin"])[1]
    code, out, err = await tether(app, boss, "devices", "tag", "old", "--add", "gpu", "--add", "lab",
                                  "--remove", "own")
    assert code == 0, (out, err)
    assert "tags gpu, lab" in out
    code, out, err = await tether(app, boss, "devices", "rename", "old", "new")
    assert code == 1 and "connected" in err, (out, err)
    await dev.close()
    assert await app.hub.registry.wait_until(lambda: not app.hub.connected("old"), WAIT)
    app.hub._grace.stop("old")  # the grace period would hold the name for 30 s
    code, out, err = await tether(app, boss, "devices", "rename", "old", "new")
    assert code == 0 and "renamed device old to new" in out, (out, err)
    code, out, err = await tether(app, boss, "devices", "tag", "new", "--remove", "lab")
    assert code == 0 and "tags gpu" in out, (out, err)
    code, out, _ = await tether(app, boss, "devices", "show", "new", "--json")
    assert json.loads(out)["tags"] == ["gpu"]
    code, out, err = await tether(app, boss, "devices", "tag", "new")
    assert code == 2 and "--add" in err
    code, out, err = await tether(app, app.runner, "devices", "tag", "new", "--add", "x")
    assert code != 0 and "Traceback" not in err
