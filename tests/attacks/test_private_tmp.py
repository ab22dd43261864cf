"""A private /tmp per session (issue 26, item 5; `private_tmp: true`): what one session's command leaves in /tmp is
seen by that session alone — its later commands (read-only ones included), its file tools and its transfers —
never by another session's, and it goes when the session ends (a task that ends, a one-off `tether exec`
call, the `end_session` meta tool), or once idle past the device's session timeout (a device that missed it).

Tried as an attacker would, with a real device and its real bubblewrap sandbox (write roots: a fresh
HOME and the machine's /tmp); the attacker knows the other session's file name and looks for it by every
way a session has: a command, `read_file`, `list_directory`, and the sessions' base directory itself.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import secrets
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.kits.aip import logged
from tests.kits.confined_device import SYSTEM_PYTHON, attacker_factory, home, stdout, text  # noqa: F401 (fixtures)
from tests.kits.netutil import CLI
from tests.kits.task import AgentServer
from tether.protocol.models import Command, Result, ResultStatus
from tether.sandbox.private_tmp import session_key
from tether.tools.policy.model import policy_from_mapping

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
    base, own = private.base, f"{private.base}/{session_key(session)}"
    await attacker.device.aclose()

    again = await attacker_factory(allow_inline_code=True, private_tmp=True)  # a session not yet ended keeps its /tmp
    kept = await cat(again, session, f"{TMP}/left")
    assert stdout(kept) == "kept\n", text(kept)
    read = await _tool(again, session, "read_file", file_path=f"{TMP}/left")  # and its file tools map it still
    assert read.status is ResultStatus.SUCCESS and "kept" in text(read), text(read)
    assert again.device.context.sandbox.private_tmp.base == base  # type: ignore[union-attr]
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


async def test_read_only_commands_and_transfers_see_their_sessions_tmp_which_goes_when_it_ends(
        attacker_factory, home: Path) -> None:  # noqa: F811
    attacker = await attacker_factory(allow_inline_code=True, private_tmp=True)
    private = attacker.device.context.sandbox.private_tmp  # type: ignore[union-attr]
    assert private is not None
    name = f"tether-ro-{secrets.token_hex(4)}"
    machine = Path(TMP) / f"{name}-machine"  # another program's file in the machine's /tmp
    machine.write_text("the machine's\n")
    a, b = f"a-{secrets.token_hex(3)}", f"b-{secrets.token_hex(3)}"
    try:
        wrote = await py(attacker, a, f"open({TMP!r} + '/{name}', 'w').write('secret-of-a\\n')")
        assert wrote.status is ResultStatus.SUCCESS, text(wrote)
        # a read-only command sees its session's /tmp: what its own writing commands left, not the machine's
        mine = await _tool(attacker, a, "shell_execute_read", command=f"cat {TMP}/{name}")
        assert mine.status is ResultStatus.SUCCESS and stdout(mine) == "secret-of-a\n", text(mine)
        listed = await _tool(attacker, a, "shell_execute_read", command=f"ls -a {TMP}")
        assert name in stdout(listed) and machine.name not in stdout(listed), text(listed)
        for command in (f"cat {TMP}/{name}", f"cat {machine}", f"ls -a {TMP}"):  # nor another session's
            theirs = await _tool(attacker, b, "shell_execute_read", command=command)
            assert "secret-of-a" not in text(theirs) and "the machine's" not in text(theirs), text(theirs)
            assert name not in stdout(theirs), text(theirs)

        # a transfer from the session's /tmp sends its file; another session's transfer finds nothing there
        manifest = await _tool(attacker, a, "transfer_manifest", path=f"{TMP}/{name}")
        assert manifest.status is ResultStatus.SUCCESS, text(manifest)
        [entry] = manifest.result["entries"]
        assert entry["sha256"] == hashlib.sha256(b"secret-of-a\n").hexdigest(), manifest.result
        chunk = await _tool(attacker, a, "read_file_chunk", path=manifest.result["root"], offset=0, length=100,
                            size=entry["size"])
        assert base64.b64decode(chunk.result["data"]) == b"secret-of-a\n", text(chunk)
        for path in (f"{TMP}/{name}", manifest.result["root"]):  # by its /tmp name, and by its real one
            probe = await _tool(attacker, b, "transfer_manifest", path=path)
            assert probe.status is ResultStatus.FAILURE and "secret" not in text(probe), text(probe)
            stolen = await _tool(attacker, b, "read_file_chunk", path=path, offset=0, length=100, size=12)
            assert stolen.status is ResultStatus.FAILURE and "data" not in (stolen.result or {}), text(stolen)
        # a transfer into /tmp lands in the receiving session's /tmp, where its commands find it
        data = b"sent to b\n"
        entry = {"path": "", "type": "file", "size": len(data), "mode": 0o644,
                 "sha256": hashlib.sha256(data).hexdigest()}
        begin = await _tool(attacker, b, "transfer_begin", transfer_id="tprivtmp0001", dest=f"{TMP}/{name}-got",
                            kind="file", name=f"{name}-got", entries=[entry])
        assert begin.status is ResultStatus.SUCCESS, text(begin)
        root = begin.result["root"]
        put = await _tool(attacker, b, "write_file_chunk", transfer_id="tprivtmp0001", root=root, path="", index=0,
                          offset=0, size=len(data), data=base64.b64encode(data).decode())
        assert put.status is ResultStatus.SUCCESS, text(put)
        done = await _tool(attacker, b, "transfer_commit", transfer_id="tprivtmp0001", root=root, path="", index=0,
                           type="file", size=len(data), sha256=entry["sha256"])
        assert done.status is ResultStatus.SUCCESS, text(done)
        assert not os.path.exists(f"{TMP}/{name}-got")
        got = await _tool(attacker, b, "shell_execute_read", command=f"cat {TMP}/{name}-got")
        assert stdout(got) == "sent to b\n", text(got)
        assert "sent to b" not in text(await _tool(attacker, a, "shell_execute_read", command=f"cat {TMP}/{name}-got"))

        # a's session ends: its /tmp goes at once, b's stays; a session with nothing there has nothing to remove
        a_dir, b_dir = f"{private.base}/{session_key(a)}", f"{private.base}/{session_key(b)}"
        assert os.path.isdir(a_dir)
        ended = await _tool(attacker, a, "end_session")
        assert ended.status is ResultStatus.SUCCESS and ended.result == {"session_id": a, "tmp_removed": True}
        assert not os.path.exists(a_dir) and os.path.isdir(b_dir)
        gone = await _tool(attacker, a, "shell_execute_read", command=f"cat {TMP}/{name}")
        assert "secret-of-a" not in text(gone), text(gone)
        none = await _tool(attacker, f"c-{secrets.token_hex(3)}", "end_session")
        assert none.status is ResultStatus.SUCCESS and none.result["tmp_removed"] is False, text(none)
    finally:
        machine.unlink()


async def test_a_tasks_tmp_is_its_own_and_goes_once_the_task_ends(
        home: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    caplog.set_level(logging.INFO, logger="tether.device.computer")
    name = f"tether-task-{secrets.token_hex(4)}"
    write = {"skill": "shell.run", "description": "download into /tmp",
             "args": {"cmd": SYSTEM_PYTHON, "argv": ["-c", f"open({TMP!r} + '/{name}', 'w').write('fetched')"],
                      "cwd": str(home)}}
    read = {"skill": "read_file", "description": "read it", "args": {"file_path": f"{TMP}/{name}"}}
    async with AgentServer(tmp_path) as server:
        device = await server.add_device("alpha", policy_from_mapping({"allow_inline_code": True, "private_tmp": True}),
                                         tmp_path / "state-alpha")
        private = device.context.sandbox.private_tmp  # type: ignore[union-attr]
        assert private is not None
        first = (await server.create(request="fetch and read", device="alpha", plan=[write, read]))["id"]
        task = await server.finished(first)
        assert task["state"] == "done", task
        assert "fetched" in json.dumps(task["steps"][1]["result"]), task["steps"][1]  # the command's file, read_file
        assert not os.path.exists(f"{TMP}/{name}")
        await logged(caplog, f"session {first} ended: its private /tmp removed")  # told once the task ended
        assert not os.path.exists(f"{private.base}/{session_key(first)}")

        second = (await server.create(request="read another task's file", device="alpha", plan=[read]))["id"]
        seen = await server.events_until(second, lambda e: e["kind"] == "step_finished")
        assert seen[-1]["data"]["status"] == "failure" and "fetched" not in json.dumps(seen), seen[-1]
        assert (await server.api.post(f"/tasks/{second}/cancel")).status_code == 200


def _local_exec(home: Path, tmp_path: Path, state: str = "state") -> tuple[Path, Any]:  # noqa: F811
    """The CLI's device of the state directory `tmp_path/state`: its temp dir (a write root, given to each session
    privately) and a function running one `tether exec --json` call on it. The user's layers directory is
    `tmp_path/layers`, shared by every state directory of the test as the user's default one would be."""
    temp = tmp_path / "temp"  # the CLI's device: its temp dir, a write root, given to each session privately
    temp.mkdir(exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "OPENAI_"))
              or k in ("TETHER_ALLOW_ROOT", "TETHER_RUN_AS")},
           "HOME": str(home), "TMPDIR": str(temp), "TETHER_STATE_DIR": str(tmp_path / state), "NO_COLOR": "1",
           "TETHER_SANDBOX_LAYERS": str(tmp_path / "layers")}
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"private_tmp": True, "allow_inline_code": True}))

    def tether(*args: str, wait: bool = True) -> Any:
        proc = subprocess.Popen([*CLI, "exec", "--json", "--policy", str(policy), *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL)

        def answer() -> Any:
            out, err = proc.communicate(timeout=120)
            assert "Traceback" not in err, err
            return json.loads(out)
        return answer() if wait else answer
    return temp, tether


def test_two_one_off_exec_calls_do_not_share_tmp_and_each_ends_with_its_call(home: Path, tmp_path: Path) -> None:  # noqa: F811
    temp, tether = _local_exec(home, tmp_path)

    wrote = tether("write_file", f"file_path={temp}/note", "content=from the first call")
    assert wrote["status"] == "success", wrote
    assert not (temp / "note").exists()
    assert not list(temp.glob(".tether-tmp-*")), "the one-off call's /tmp (and its base, left empty) outlived it"
    read = tether("read_file", f"file_path={temp}/note")
    assert read["status"] == "failure" and "from the first call" not in json.dumps(read), read
    # a session named by the caller goes on between calls
    named = tether("--session", "mine", "write_file", f"file_path={temp}/note", "content=kept")
    assert named["status"] == "success", named
    [base] = temp.glob(".tether-tmp-*")  # the session lives on: so does the base that holds its /tmp
    assert [p.name for p in base.iterdir()] == [session_key("mine")]
    again = tether("--session", "mine", "read_file", f"file_path={temp}/note")
    assert again["status"] == "success" and "kept" in json.dumps(again), (again, sorted(map(str, temp.rglob("*"))))


def test_two_local_devices_of_one_user_each_keep_their_own_tmp(home: Path, tmp_path: Path) -> None:  # noqa: F811
    """Two state directories of one user (one temp dir, one layers directory), called at once with the same session
    name: each call's command writes in its /tmp; neither device's next call (its device run again) sees the
    other's file, and each finds its own."""
    temp, alpha = _local_exec(home, tmp_path, "state-alpha")
    _, beta = _local_exec(home, tmp_path, "state-beta")

    def write(tether: Any, text: str) -> Any:
        code = f"open({str(temp)!r} + '/note', 'w').write({text!r})"
        return tether("--session", "same", "shell.run", f"cmd={SYSTEM_PYTHON}", f"argv:={json.dumps(['-c', code])}",
                      f"cwd={home}", wait=False)

    def read(tether: Any) -> Any:
        return tether("--session", "same", "shell.run", "cmd=cat", f"argv:={json.dumps([f'{temp}/note'])}",
                      f"cwd={home}", wait=False)

    wrote = [write(alpha, "alpha's"), write(beta, "beta's")]  # both devices at once
    assert all(w()["status"] == "success" for w in wrote)
    assert not (temp / "note").exists()
    a, b = read(alpha), read(beta)  # each device again, at once: its session's /tmp found through its own record
    seen_a, seen_b = a(), b()
    assert seen_a["status"] == "success" and "alpha's" in json.dumps(seen_a) and "beta's" not in json.dumps(seen_a), \
        seen_a
    assert seen_b["status"] == "success" and "beta's" in json.dumps(seen_b) and "alpha's" not in json.dumps(seen_b), \
        seen_b
    assert len(list(temp.glob(".tether-tmp-*"))) == 2
    assert not list((tmp_path / "layers").glob("*private-tmp-base*"))


async def test_a_live_process_sees_no_sessions_tmp(attacker_factory, home: Path) -> None:  # noqa: F811
    """A sandboxed stdio MCP server runs under bwrap directly with the machine's /tmp bound writable
    (`bwrap.live_argv`): the sessions' base is an empty read-only directory there."""
    import asyncio

    from tether.sandbox.confine.bwrap import live_argv

    attacker = await attacker_factory(allow_inline_code=True, private_tmp=True)
    sandbox = attacker.device.context.sandbox  # type: ignore[union-attr]
    wrote = await py(attacker, "a", f"open({TMP!r} + '/for-a-only', 'w').write('secret-of-a')")
    assert wrote.status is ResultStatus.SUCCESS, text(wrote)
    own = f"{sandbox.private_tmp.base}/{session_key('a')}"
    code = f"""
import os
for path in ({sandbox.private_tmp.base!r}, {own!r} + '/for-a-only'):
    try:
        print(os.listdir(path) if os.path.isdir(path) else open(path).read(), end=' ')
    except OSError as e:
        print(type(e).__name__, end=' ')
try:
    open({sandbox.private_tmp.base!r} + '/planted', 'w')
    print('planted')
except OSError as e:
    print(type(e).__name__)
"""
    argv = live_argv(sandbox.spec, [SYSTEM_PYTHON, "-c", code], bwrap=sandbox.info.bwrap,
                     hide=sandbox.live_hidden())
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert out.decode().split() == ["[]", "FileNotFoundError", "OSError"], (out, err)
    assert not os.path.exists(f"{sandbox.private_tmp.base}/planted")


async def test_turned_off_every_session_shares_the_machines_captured_tmp(attacker_factory, home: Path) -> None:  # noqa: F811
    attacker = await attacker_factory(allow_inline_code=True, private_tmp=False)
    assert attacker.device.context.sandbox.private_tmp is None  # type: ignore[union-attr]
    path = f"{TMP}/tether-shared-{secrets.token_hex(4)}"
    try:
        wrote = await py(attacker, "a", f"open({path!r}, 'w').write('shared')")
        assert wrote.status is ResultStatus.SUCCESS, text(wrote)
        assert any(c["path"] == path for c in wrote.result["changes"]), text(wrote)  # captured, then applied
        assert Path(path).read_text() == "shared"
        seen = await _tool(attacker, "b", "shell_execute_read", command=f"cat {path}")
        assert stdout(seen) == "shared", text(seen)
    finally:
        Path(path).unlink(missing_ok=True)
