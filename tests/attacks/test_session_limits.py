"""Limits per session as well as per command (issue 26, item 5): a session's commands together cannot
create more files, nor write more bytes, than the policy's session totals, however the work is split.

Tried as an attacker would, with a real device and its real bubblewrap sandbox: each command stays under
the per-command layer limits, and the session adds them up; the command that would pass a total fails
naming it and applies nothing, while another session still works, and what fits exactly still fits.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from tests.kits.confined_device import SYSTEM_PYTHON, attacker_factory, home, text  # noqa: F401 (fixtures)
from tether.protocol.models import ResultStatus


async def test_a_session_cannot_split_past_its_totals(attacker_factory, home: Path) -> None:  # noqa: F811
    limits = {"layer_files": 100, "session_files": 5, "session_bytes": 1 << 20}
    attacker = await attacker_factory(allow_inline_code=True, limits=limits)
    tag = secrets.token_hex(4)

    async def make(session: str, names: list[str], size: int = 1) -> object:
        code = f"import sys\nfor name in sys.argv[1:]:\n    open(name, 'wb').write(b'x' * {size})\nprint('made')"
        return await attacker.run(SYSTEM_PYTHON, "-c", code, *[str(home / n) for n in names], session=session)

    first = await make("s1", [f"{tag}-a{n}" for n in range(3)])
    assert first.status is ResultStatus.SUCCESS, text(first)
    over = await make("s1", [f"{tag}-b{n}" for n in range(3)])  # 6 > 5: the whole command is refused
    assert over.status is ResultStatus.FAILURE and "limits.session_files" in (over.error or ""), text(over)
    assert over.result["limit"] == "limits.session_files" and over.result["applied"] is False, text(over)
    assert not any((home / f"{tag}-b{n}").exists() for n in range(3)), "a refused command's files were applied"
    other = await make("s2", [f"{tag}-c{n}" for n in range(3)])  # another session has its own totals
    assert other.status is ResultStatus.SUCCESS, text(other)
    fits = await make("s1", [f"{tag}-d{n}" for n in range(2)])  # exactly 5
    assert fits.status is ResultStatus.SUCCESS and (home / f"{tag}-d1").exists(), text(fits)
    await attacker.device.aclose()  # a restarted device does not start the session afresh
    kept = home / ".local/state/tether/session-totals.json"
    assert kept.stat().st_mode & 0o777 == 0o600
    attacker = await attacker_factory(allow_inline_code=True, limits=limits)
    after = await make("s1", [f"{tag}-f0"])
    assert after.status is ResultStatus.FAILURE and "limits.session_files" in (after.error or ""), text(after)
    assert not (home / f"{tag}-f0").exists()

    half = 600 * 1024
    big = await make("s3", [f"{tag}-e0"], size=half)
    assert big.status is ResultStatus.SUCCESS, text(big)
    bigger = await make("s3", [f"{tag}-e1"], size=half)  # 1.2 MB > 1 MiB together
    assert bigger.status is ResultStatus.FAILURE and "limits.session_bytes" in (bigger.error or ""), text(bigger)
    assert not (home / f"{tag}-e1").exists()
    small = await make("s3", [f"{tag}-e2"], size=1000)  # what still fits is still applied
    assert small.status is ResultStatus.SUCCESS and (home / f"{tag}-e2").exists(), text(small)


async def test_a_session_cannot_run_more_processes_than_its_total(attacker_factory, home: Path) -> None:  # noqa: F811
    """Each sandboxed start takes its pid cap from the session's total and holds it while it runs: two
    launched applications (which outlive their calls) take all of a 600-process session, so its next
    command is refused before it starts; another session runs; commands that end give their share back."""
    from tether.protocol.models import Command

    attacker = await attacker_factory(allow_inline_code=True, limits={"processes": 300, "session_processes": 600})
    stay = "import signal; signal.pause()"  # runs until the device stops it

    async def call(session: str, tool: str, **params: object) -> object:
        [result] = await attacker.device.dispatcher(session_id=session).execute_commands(
            [Command(tool_name=tool, parameters=params)])
        return result

    for _ in range(2):
        launched = await call("p1", "launch_application", app_name=SYSTEM_PYTHON, args=["-c", stay])
        assert launched.status is ResultStatus.SUCCESS, text(launched)
    refused = await attacker.run(SYSTEM_PYTHON, "-c", "print('ran')", session="p1")
    assert refused.status is ResultStatus.FAILURE and "limits.session_processes" in (refused.error or ""), \
        text(refused)
    assert refused.result["limit"] == "limits.session_processes" and "ran" not in text(refused)
    third = await call("p1", "launch_application", app_name=SYSTEM_PYTHON, args=["-c", stay])
    assert third.status is ResultStatus.FAILURE and "limits.session_processes" in (third.error or ""), text(third)
    for n in range(3):  # 3 x 300 > 600, one after another: each gives its share back when it ends
        done = await attacker.run(SYSTEM_PYTHON, "-c", f"print({n})", session="p2")
        assert done.status is ResultStatus.SUCCESS, text(done)
