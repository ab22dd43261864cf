"""`tether exec --all` (issue 13): the real CLI process against a real server on 127.0.0.1.

The server (the whole app under uvicorn) and its scripted devices live in the test's event loop; the
CLI is a subprocess awaited without blocking that loop. What a user sees: the summary table, every
device that did not succeed with its error (printed, never read as markup), the exit code, NDJSON with
--json, and a one-line `error:` without a traceback when something is wrong.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.kits.aip import WAIT
from tests.kits.fanout import App, running_app
from tether.protocol.models import Command, Result

CLI = [sys.executable, "-m", "tether.cli"]


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[App]:
    async with running_app(tmp_path) as running:
        yield running


async def tether(app: App | None, *args: str, server: str | None = None) -> tuple[int, str, str]:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200",
           "TETHER_SERVER": server or (app.url if app else ""), "TETHER_TOKEN": app.runner if app else "x"}
    proc = await asyncio.create_subprocess_exec(*CLI, *args, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def boom(command: Command) -> Result:
    return Result.failure("[bold]disk[/bold] full on /var", command.call_id)


async def test_the_summary_the_failures_and_exit_code_1(app: App) -> None:
    serving = [(await app.device(n, ["lab"])).serve_forever() for n in ("a1", "a2")]
    serving.append((await app.device("a3", ["lab"])).serve_forever(boom))
    away = await app.device("a4", ["lab"])
    await away.close()
    assert await app.hub.registry.wait_until(lambda: not app.hub.connected("a4"), WAIT)
    serving.append((await app.device("b1", ["office"])).serve_forever(boom))
    code, out, err = await tether(app, "exec", "--all", "--require", "tag=lab", "noop", "n:=1")
    assert code == 1, (out, err)
    assert "Traceback" not in out + err
    header = next(line for line in out.splitlines() if "timed out" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == ["ok", "failed", "offline", "timed out", "cancelled"]
    row = next(line for line in out.splitlines() if line.startswith("│"))
    assert [c.strip() for c in row.strip("│").split("│")] == ["2", "1", "1", "0", "0"]
    assert "4 device(s)" in out
    assert "a3: failed: [bold]disk[/bold] full on /var" in out  # the device's text as it is
    assert "a4: offline: device a4 is offline; not sent" in out
    assert "b1" not in out
    for task in serving:
        task.cancel()


async def test_all_ok_exits_0_and_json_prints_the_lines(app: App) -> None:
    serving = [(await app.device(n)).serve_forever() for n in ("a1", "a2", "a3")]
    code, out, err = await tether(app, "exec", "--all", "noop", "n:=2")
    assert code == 0, (out, err)
    row = next(line for line in out.splitlines() if line.startswith("│"))
    assert [c.strip() for c in row.strip("│").split("│")] == ["3", "0", "0", "0", "0"]
    code, out, err = await tether(app, "exec", "--all", "--json", "--max-concurrency", "2", "noop", "n:=2")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0]["fanout"]["total"] == 3 and lines[-1]["summary"]["ok"] == 3
    assert sorted(line["device"] for line in lines[1:-1]) == ["a1", "a2", "a3"]
    assert all(line["results"][0]["result"] == {"tool": "noop", "args": {"n": 2}} for line in lines[1:-1])
    for task in serving:
        task.cancel()


async def test_errors_are_one_line_without_a_traceback(app: App, free_port: int) -> None:
    await app.device("a1", ["lab"])
    code, _, err = await tether(app, "exec", "--all", "--require", "tag=[red]gpu", "noop")
    assert code == 1 and err.startswith("error: server answered 404: no device fits {tags: [\"[red]gpu\"]}"), err
    code, _, err = await tether(app, "exec", "--require", "tag=lab", "noop")
    assert code == 2 and "add --all" in err
    code, _, err = await tether(app, "exec", "--all", "--device", "a1", "noop")
    assert code == 2 and "does not take --device" in err
    code, _, err = await tether(app, "exec", "--all", "--require", "colour=blue", "noop")
    assert code == 2 and "expected platform=NAME" in err
    code, _, err = await tether(None, "exec", "--all", "noop", server=f"http://127.0.0.1:{free_port}")
    assert code == 4 and err.startswith("error: cannot reach the tether server") and "Traceback" not in err
