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
    attacker = await attacker_factory(allow_inline_code=True, limits={
        "layer_files": 100, "session_files": 5, "session_bytes": 1 << 20})
    tag = secrets.token_hex(4)

    async def make(session: str, names: list[str], size: int = 1) -> object:
        code = "import sys\nfor name in sys.argv[1:]:\n    open(name, 'wb').write(b'x' * %d)\nprint('made')" % size
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

    half = 600 * 1024
    big = await make("s3", [f"{tag}-e0"], size=half)
    assert big.status is ResultStatus.SUCCESS, text(big)
    bigger = await make("s3", [f"{tag}-e1"], size=half)  # 1.2 MB > 1 MiB together
    assert bigger.status is ResultStatus.FAILURE and "limits.session_bytes" in (bigger.error or ""), text(bigger)
    assert not (home / f"{tag}-e1").exists()
    small = await make("s3", [f"{tag}-e2"], size=1000)  # what still fits is still applied
    assert small.status is ResultStatus.SUCCESS and (home / f"{tag}-e2").exists(), text(small)
