"""A private /tmp per session (issue 26, item 5): what one session's command leaves in /tmp is seen by that
session alone — its later commands and its file tools — never by another session's commands or file
tools, and it goes once the session has ended (idle past the device's session timeout).

Tried as an attacker would, with a real device and its real bubblewrap sandbox (write roots: a fresh
HOME and the machine's /tmp); the attacker knows the other session's file name and looks for it by every
way a session has: a command, `read_file`, `list_directory`, and the sessions' base directory itself.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

from tests.kits.confined_device import SYSTEM_PYTHON, attacker_factory, home, stdout, text  # noqa: F401 (fixtures)
from tether.protocol.models import Command, Result, ResultStatus
from tether.sandbox.private_tmp import session_key

TMP = os.path.realpath(tempfile.gettempdir())


async def _tool(attacker: object, session: str, tool: str, **params: object) -> Result:
    [result] = await attacker.device.dispatcher(session_id=session).execute_commands(  # type: ignore[attr-defined]
        [Command(tool_name=tool, parameters=params)])
    return result


async def py(attacker: object, session: str, code: str) -> Result:
    return await attacker.run(SYSTEM_PYTHON, "-c", code, session=session)  # type: ignore[attr-defined,no-any-return]


async def cat(attacker: object, session: str, path: str) -> Result:
    return await py(attacker, session, f"import sys; sys.stdout.write(open({path!r}).read())")


async def test_one_sessions_tmp_is_invisible_to_another(attacker_factory, home: Path) -> None:  # noqa: F811
    attacker = await attacker_factory(allow_inline_code=True, private_tmp=True)
    name = f"tether-private-{secrets.token_hex(4)}"
    a, b = f"a-{secrets.token_hex(3)}", f"b-{secrets.token_hex(3)}"
    wrote = await py(attacker, a, f"open({TMP!r} + '/{name}', 'w').write('secret-of-a\\n')")
    assert wrote.status is ResultStatus.SUCCESS, text(wrote)
    assert not os.path.exists(f"{TMP}/{name}"), "session A's /tmp file reached the machine's /tmp"

    again = await cat(attacker, a, f"{TMP}/{name}")  # A's next command sees it
    assert again.status is ResultStatus.SUCCESS and stdout(again) == "secret-of-a\n", text(again)
    read = await _tool(attacker, a, "read_file", file_path=f"{TMP}/{name}")  # and A's file tools
    assert read.status is ResultStatus.SUCCESS and "secret-of-a" in text(read), text(read)

    seen = await py(attacker, b, f"import os; print(os.listdir({TMP!r})); print(open({TMP!r} + '/{name}').read())")
    assert "secret-of-a" not in text(seen) and name not in stdout(seen), text(seen)
    read_b = await _tool(attacker, b, "read_file", file_path=f"{TMP}/{name}")
    assert read_b.status is ResultStatus.FAILURE and "secret-of-a" not in text(read_b), text(read_b)
    listed = await _tool(attacker, b, "list_directory", path=TMP)
    assert name not in text(listed), text(listed)

    base = attacker.device.context.sandbox.private_tmp.base  # type: ignore[union-attr]
    a_dir = f"{base}/{session_key(a)}"
    assert os.stat(a_dir).st_mode & 0o777 == 0o700 and os.stat(base).st_mode & 0o777 == 0o700
    # B names A's directory by its real path: through a command (the machine's /tmp is not there at all),
    # through a file tool, and through a link B plants in its own /tmp
    direct = await cat(attacker, b, f"{a_dir}/{name}")
    assert "secret-of-a" not in text(direct), text(direct)
    nobody = await cat(attacker, None, f"{a_dir}/{name}")  # type: ignore[arg-type]  # a command of no session
    assert nobody.status is ResultStatus.FAILURE and "secret-of-a" not in text(nobody), text(nobody)
    for path in (f"{a_dir}/{name}", a_dir, base):
        probe = await _tool(attacker, b, "read_file", file_path=path)
        assert probe.status is ResultStatus.FAILURE and "secret-of-a" not in text(probe), text(probe)
        listing = await _tool(attacker, b, "list_directory", path=path)
        assert listing.status is ResultStatus.FAILURE and name not in text(listing), text(listing)
    link = await py(attacker, b, f"import os; os.symlink({a_dir!r} + '/{name}', {TMP!r} + '/link')")
    assert link.status is ResultStatus.SUCCESS, text(link)
    followed = await _tool(attacker, b, "read_file", file_path=f"{TMP}/link")
    assert followed.status is ResultStatus.FAILURE and "secret-of-a" not in text(followed), text(followed)
    # a session's write_file into /tmp lands in its own /tmp too, seen by its commands
    put = await _tool(attacker, b, "write_file", file_path=f"{TMP}/{name}-b", content="from-b-tool")
    assert put.status is ResultStatus.SUCCESS and not os.path.exists(f"{TMP}/{name}-b"), text(put)
    got = await cat(attacker, b, f"{TMP}/{name}-b")
    assert stdout(got) == "from-b-tool", text(got)
    assert "from-b-tool" not in text(await cat(attacker, a, f"{TMP}/{name}-b"))

    # a directory A made in its /tmp is a cwd for A's commands, and for no one else's
    made = await py(attacker, a, f"import os; os.mkdir({TMP!r} + '/work-{name}')")
    assert made.status is ResultStatus.SUCCESS, text(made)
    inside = await attacker.run(SYSTEM_PYTHON, "-c", "import os; print(os.getcwd())", session=a,
                                cwd=f"{TMP}/work-{name}")
    assert stdout(inside) == f"{TMP}/work-{name}\n", text(inside)
    elsewhere = await attacker.run(SYSTEM_PYTHON, "-c", "print('ran')", session=b, cwd=f"{TMP}/work-{name}")
    assert elsewhere.status is ResultStatus.FAILURE and "ran" not in stdout(elsewhere), text(elsewhere)

    # A ends: idle past the session timeout (its directory's last use set back a day and a second); the
    # next new session's first command removes it, and B's directory, still in use, stays
    day_ago = os.stat(a_dir).st_mtime - attacker.device.context.sandbox.private_tmp.idle_s - 1  # type: ignore
    os.utime(a_dir, (day_ago, day_ago))
    sweeper = attacker.device.context.sandbox  # type: ignore[union-attr]
    fresh = await py(attacker, f"c-{secrets.token_hex(3)}", "pass")
    assert fresh.status is ResultStatus.SUCCESS, text(fresh)
    assert sweeper._tmp_sweep is not None
    assert await sweeper._tmp_sweep == [session_key(a)]  # the new session's first use swept (off the loop)
    assert not os.path.exists(a_dir), "an ended session's /tmp is still there"
    assert os.path.isdir(f"{base}/{session_key(b)}")


async def test_a_restarted_device_removes_ended_sessions_tmp(attacker_factory, home: Path) -> None:  # noqa: F811
    attacker = await attacker_factory(allow_inline_code=True, private_tmp=True)
    session = f"r-{secrets.token_hex(3)}"
    wrote = await py(attacker, session, f"open({TMP!r} + '/left', 'w').write('kept\\n')")
    assert wrote.status is ResultStatus.SUCCESS, text(wrote)
    private = attacker.device.context.sandbox.private_tmp  # type: ignore[union-attr]
    own = f"{private.base}/{session_key(session)}"
    await attacker.device.aclose()

    again = await attacker_factory(allow_inline_code=True, private_tmp=True)  # a session not yet ended keeps its /tmp
    kept = await cat(again, session, f"{TMP}/left")
    assert stdout(kept) == "kept\n", text(kept)
    assert again.device.context.sandbox.private_tmp.base == private.base  # type: ignore[union-attr]
    await again.device.aclose()

    past = os.stat(own).st_mtime - private.idle_s - 1
    os.utime(own, (past, past))
    third = await attacker_factory(allow_inline_code=True, private_tmp=True)
    done = await py(third, session, "pass")  # the warden's start sweeps before anything runs
    assert done.status is ResultStatus.SUCCESS, text(done)
    gone = await cat(third, session, f"{TMP}/left")
    assert "kept" not in stdout(gone), text(gone)


async def test_named_roots_below_tmp_stay_the_machines_and_programs_run_from_the_sessions_tmp(
        attacker_factory, home: Path, tmp_path: Path) -> None:  # noqa: F811
    work = tmp_path / "project"  # a project the policy names in /tmp (pytest's tmp_path lies there)
    work.mkdir()
    assert str(work.resolve()).startswith(TMP + "/")
    work = work.resolve()
    (work / "notes.txt").write_text("the machine's\n")
    attacker = await attacker_factory(allow_inline_code=True, private_tmp=True, allow_escapes=["writable-executable"],
                                      write_roots=[str(home), TMP, str(work)],
                                      commands={os.path.basename(SYSTEM_PYTHON): {}, "fetched.sh": {}})
    seen = await cat(attacker, "s", f"{work}/notes.txt")  # visible to the session's commands as the machine's
    assert stdout(seen) == "the machine's\n", text(seen)
    wrote = await py(attacker, "s", f"open({str(work)!r} + '/made.txt', 'w').write('made\\n')")
    assert wrote.status is ResultStatus.SUCCESS, text(wrote)  # captured as before, then applied to the machine
    assert any(c["path"] == f"{work}/made.txt" for c in wrote.result["changes"]), text(wrote)
    assert (work / "made.txt").read_text() == "made\n"
    cwd = await attacker.run(SYSTEM_PYTHON, "-c", "import os; print(os.getcwd())", session="s", cwd=str(work))
    assert stdout(cwd) == f"{work}\n", text(cwd)
    read = await _tool(attacker, "t", "read_file", file_path=f"{work}/made.txt")  # any session's file tools too
    assert read.status is ResultStatus.SUCCESS and "made" in text(read), text(read)

    script = f"{TMP}/fetched.sh"  # a program the session downloaded into its own /tmp
    put = await py(attacker, "s", f"import os; open({script!r}, 'w').write('#!/bin/sh\\necho from-own-tmp\\n'); "
                                  f"os.chmod({script!r}, 0o755)")
    assert put.status is ResultStatus.SUCCESS and not os.path.exists(script), text(put)
    ran = await attacker.run(script, session="s")
    assert ran.status is ResultStatus.SUCCESS and stdout(ran) == "from-own-tmp\n", text(ran)
    other = await attacker.run(script, session="t")  # another session has no such program
    assert other.status is ResultStatus.FAILURE and "from-own-tmp" not in stdout(other), text(other)
