"""File tools through the tool set: jail, approvals, journaling and byte-exact undo."""

from __future__ import annotations

import asyncio
import base64
import os
import stat
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kits.results import failed, ok
from tether.protocol.models import Result
from tether.tools.context import ToolContext
from tether.tools.files.tool import files_toolset
from tether.tools.journal import UndoJournal
from tether.tools.policy.model import Policy


@dataclass
class Env:
    root: Path
    work: Path  # inside the roots, outside the temp dir: changes need approval
    scratch: Path  # the temp dir: changes go ahead
    outside: Path  # outside the roots
    journal: UndoJournal
    ctx: ToolContext

    async def call(self, name: str, ctx: ToolContext | None = None, **args: Any) -> Result:
        return await files_toolset().call(name, args, ctx or self.ctx)

    @property
    def approved(self) -> ToolContext:
        return replace(self.ctx, approved_by="alice")


@pytest.fixture
def env(tmp_path: Path) -> Env:
    root, outside = tmp_path / "root", tmp_path / "outside"
    work, scratch = root / "work", root / "scratch"
    for d in (work, scratch, outside):
        d.mkdir(parents=True)
    journal = UndoJournal(tmp_path / "state")
    policy = Policy(read_roots=[str(root)], write_roots=[str(root)])
    ctx = ToolContext(policy=policy, journal=journal, session_id="s1", temp_dir=str(scratch))
    return Env(root, work, scratch, outside, journal, ctx)


def rand(n: int = 5000) -> bytes:
    return os.urandom(n) + b"\x00"


# ------------------------------------------------------------------------------------------ reading


async def test_read_text_and_binary(env: Env) -> None:
    (env.work / "t.txt").write_text("héllo\n", encoding="utf-8")
    res = ok(await env.call("read_file", file_path=str(env.work / "t.txt")))
    assert res["content"] == "héllo\n" and res["encoding"] == "utf-8" and not res["binary"]
    assert res["size"] == len("héllo\n".encode()) and not res["truncated"]

    data = rand()
    (env.work / "b.bin").write_bytes(data)
    res = ok(await env.call("read_file", file_path=str(env.work / "b.bin")))
    assert res["binary"] and res["encoding"] == "base64"
    assert base64.b64decode(res["content"]) == data


async def test_undecodable_text_is_base64(env: Env) -> None:
    (env.work / "latin.txt").write_bytes("café".encode("latin-1"))
    res = ok(await env.call("read_file", file_path=str(env.work / "latin.txt")))
    assert res["binary"] and base64.b64decode(res["content"]) == "café".encode("latin-1")
    res = ok(await env.call("read_file", file_path=str(env.work / "latin.txt"), encoding="latin-1"))
    assert res["content"] == "café" and not res["binary"]


async def test_truncated_reads_page_through_the_file(env: Env) -> None:
    text = "abcdé" * 1000  # é is two bytes: pages must not split it
    (env.work / "big.txt").write_text(text, encoding="utf-8")
    parts, offset = [], 0
    while True:
        res = ok(await env.call("read_file", file_path=str(env.work / "big.txt"), max_bytes=1001, offset=offset))
        assert not res["binary"]
        parts.append(res["content"])
        if not res["truncated"]:
            break
        assert res["bytes_read"] <= 1001
        offset = res["next_offset"]
    assert "".join(parts) == text and len(parts) > 5


async def test_read_errors(env: Env) -> None:
    failed(await env.call("read_file", file_path=str(env.work / "nope")), "not found")
    failed(await env.call("read_file", file_path=str(env.work)), "is a directory")
    os.mkfifo(env.work / "fifo")
    failed(await env.call("read_file", file_path=str(env.work / "fifo")), "not a regular file")
    (env.work / "f").write_text("x")
    failed(await env.call("read_file", file_path=str(env.work / "f"), encoding="klingon"), "unknown encoding")


async def test_list_dir(env: Env) -> None:
    (env.work / "a.txt").write_text("aaa")
    (env.work / ".hidden").write_text("h")
    (env.work / "sub").mkdir()
    (env.work / "link").symlink_to("a.txt")
    res = ok(await env.call("list_dir", path=str(env.work)))
    by_name = {e["name"]: e for e in res["entries"]}
    assert list(by_name) == ["a.txt", "link", "sub"]
    assert by_name["a.txt"]["type"] == "file" and by_name["a.txt"]["size"] == 3
    assert by_name["sub"]["type"] == "dir"
    assert by_name["link"]["type"] == "symlink" and by_name["link"]["target"] == "a.txt"
    assert not res["truncated"]
    res = ok(await env.call("list_dir", path=str(env.work), show_hidden=True, limit=2))
    assert [e["name"] for e in res["entries"]] == [".hidden", "a.txt"] and res["truncated"]
    failed(await env.call("list_dir", path=str(env.work / "a.txt")), "not a directory")


async def test_file_info(env: Env) -> None:
    f = env.work / "f.sh"
    f.write_text("#!/bin/sh\n")
    f.chmod(0o754)
    res = ok(await env.call("file_info", path=str(f)))
    assert res["exists"] and res["type"] == "file" and res["mode"] == "0754"
    assert res["owner_uid"] == os.getuid() and not res["is_symlink"] and res["size"] == 10
    (env.work / "ln").symlink_to("f.sh")
    res = ok(await env.call("file_info", path=str(env.work / "ln")))
    assert res["is_symlink"] and res["target"] == "f.sh" and res["type"] == "file"
    res = ok(await env.call("file_info", path=str(env.work / "missing")))
    assert res == {"path": str(env.work / "missing"), "exists": False, "is_symlink": False, "type": None}


# ------------------------------------------------------------------------------------------ jail


async def test_symlink_escaping_the_roots_is_refused(env: Env) -> None:
    secret = env.outside / "secret"
    secret.write_bytes(b"outside")
    (env.work / "escape").symlink_to(secret)
    (env.work / "outdir").symlink_to(env.outside)
    failed(await env.call("read_file", file_path=str(env.work / "escape")), "denied", "read_roots")
    failed(await env.call("file_info", path=str(env.work / "outdir" / "secret")), "read_roots")
    failed(await env.call("write_file", ctx=env.approved, file_path=str(env.work / "escape"), content="x",
                          mode="overwrite"), "denied", "write_roots")
    failed(await env.call("write_file", file_path=str(env.work / "outdir" / "new"), content="x"), "write_roots")
    failed(await env.call("delete_file", ctx=env.approved, path=str(env.work / "outdir" / "secret")),
           "write_roots")
    failed(await env.call("move_file", ctx=env.approved, source=str(env.work / "outdir" / "secret"),
                          destination=str(env.work / "stolen")), "write_roots")
    assert secret.read_bytes() == b"outside" and not (env.outside / "new").exists()


async def test_dotdot_paths_are_judged_after_resolving(env: Env) -> None:
    (env.outside / "secret").write_text("s")
    sneaky = str(env.work / ".." / ".." / "outside" / "secret")
    failed(await env.call("read_file", file_path=sneaky), "read_roots")
    failed(await env.call("write_file", file_path=str(env.work / ".." / ".." / "outside" / "x"), content="x"),
           "write_roots")
    failed(await env.call("move_file", ctx=env.approved, source=str(env.work), destination=sneaky + "2"),
           "write_roots")
    # `..` that stays inside the roots is fine
    (env.work / "in.txt").write_text("in")
    res = ok(await env.call("read_file", file_path=str(env.scratch / ".." / "work" / "in.txt")))
    assert res["content"] == "in" and res["path"] == str((env.work / "in.txt").resolve())


async def test_the_journal_is_off_limits(env: Env) -> None:
    journal = UndoJournal(env.root / "state")
    ctx = replace(env.ctx, journal=journal, approved_by="alice")
    ok(await env.call("write_file", ctx=ctx, file_path=str(env.scratch / "x"), content="x"))
    index = env.root / "state" / "journal" / "s1" / "entries.jsonl"
    failed(await env.call("read_file", ctx=ctx, file_path=str(index)), "denied", "'journal'")
    failed(await env.call("write_file", ctx=ctx, file_path=str(index), content="{}", mode="append"), "'journal'")
    failed(await env.call("delete_file", ctx=ctx, path=str(env.root / "state"), recursive=True), "'journal'")
    failed(await env.call("move_file", ctx=ctx, source=str(env.root / "state"), destination=str(env.work / "s")),
           "'journal'")
    assert [r["outcome"] for r in journal.restore("s1")] == ["removed"]


async def test_wrong_argument_types_name_the_argument(env: Env) -> None:
    failed(await env.call("read_file", file_path=42), "read_file", "file_path")
    failed(await env.call("read_file", file_path="x", max_bytes="10"), "max_bytes")
    failed(await env.call("write_file", file_path="x", content="y", mode="truncate"), "mode")
    failed(await env.call("delete_file", path=str(env.work), recursive="yes"), "recursive")
    failed(await env.call("move_file", source="a"), "destination")


# ------------------------------------------------------------------------------------------ writing


async def test_create_never_clobbers_and_needs_no_approval(env: Env) -> None:
    f = env.work / "new.txt"
    res = ok(await env.call("write_file", file_path=str(f), content="one"))
    assert res == {"path": str(f.resolve()), "bytes_written": 3, "mode": "create", "created": True,
                   "journaled": True}
    failed(await env.call("write_file", file_path=str(f), content="two"), "already exists")
    assert f.read_text() == "one"
    failed(await env.call("write_file", file_path=str(env.work / "a" / "b.txt"), content="x"), "create_parents")
    failed(await env.call("write_file", file_path=str(env.work), content="x", mode="overwrite"), "is a directory")


async def test_overwrite_outside_temp_needs_approval(env: Env) -> None:
    f = env.work / "f.txt"
    f.write_text("before")
    for mode in ("overwrite", "append"):
        error = failed(await env.call("write_file", file_path=str(f), content="after", mode=mode),
                       "needs approval", "approval.overwrite_outside_temp")
        assert str(f.resolve()) in error
    assert f.read_text() == "before"
    res = ok(await env.call("write_file", ctx=env.approved, file_path=str(f), content="after", mode="overwrite"))
    assert res["created"] is False and f.read_text() == "after"
    ok(await env.call("write_file", ctx=env.approved, file_path=str(f), content="!", mode="append"))
    assert f.read_text() == "after!"
    # in the temp dir nobody has to approve
    t = env.scratch / "t.txt"
    t.write_text("x")
    ok(await env.call("write_file", file_path=str(t), content="y", mode="overwrite"))
    assert t.read_text() == "y"


async def test_an_overwrite_carries_its_diff_and_a_held_one_what_it_would_change(env: Env) -> None:
    f = env.work / "page.html"
    f.write_text("<img src=x onerror=alert(1)>\nkeep\n")
    held = await env.call("write_file", file_path=str(f), content="<b>new</b>\nkeep\n", mode="overwrite")
    failed(held, "needs approval")
    [would] = held.result["would_change"]  # what the person approves: the diff of what it would do
    assert would["path"] == str(f.resolve()) and would["kind"] == "modified"
    assert "-<img src=x onerror=alert(1)>\n+<b>new</b>\n keep\n" in would["diff"]
    assert f.read_text().startswith("<img")  # nothing written yet
    res = ok(await env.call("write_file", ctx=env.approved, file_path=str(f), content="<b>new</b>\nkeep\n",
                            mode="overwrite"))
    assert res["diff"] == would["diff"] and (res["added"], res["removed"]) == (1, 1)
    # caps: a 2 MiB file is described, a 40,000-line one cut at 64 KiB, binary content never shown
    big, long, blob = env.scratch / "big.txt", env.scratch / "long.txt", env.scratch / "blob"
    big.write_text("x" * (2 << 20))
    long.write_text("".join(f"old {i}\n" for i in range(40_000)))
    blob.write_bytes(b"\x00secret")
    assert ok(await env.call("write_file", file_path=str(big), content="y", mode="overwrite"))[
        "diff_skipped"] == "over 1 MiB"
    cut = ok(await env.call("write_file", file_path=str(long), content="new\n", mode="overwrite"))
    assert cut["diff_truncated"] is True and cut["removed"] == 40_000 and len(cut["diff"]) <= 64 << 10
    assert ok(await env.call("write_file", file_path=str(blob), content="text", mode="overwrite"))[
        "diff_skipped"] == "binary"
    appended = ok(await env.call("write_file", file_path=str(long), content="more\n", mode="append"))
    assert "diff" not in appended and long.read_text() == "new\nmore\n"


async def test_delete_and_move_need_approval(env: Env) -> None:
    f = env.work / "f"
    f.write_text("x")
    failed(await env.call("delete_file", path=str(f)), "needs approval", "approval.delete")
    failed(await env.call("move_file", source=str(f), destination=str(env.work / "g")),
           "needs approval", "approval.move")
    (env.scratch / "s").write_text("s")
    failed(await env.call("move_file", source=str(env.scratch / "s"), destination=str(f), overwrite=True),
           "needs approval", "approval.overwrite_outside_temp")
    assert f.read_text() == "x" and (env.scratch / "s").exists()
    ok(await env.call("move_file", source=str(env.scratch / "s"), destination=str(env.scratch / "s2")))
    ok(await env.call("delete_file", path=str(env.scratch / "s2")))
    assert not (env.scratch / "s2").exists()


async def test_undo_restores_overwritten_deleted_and_moved_files_byte_for_byte(env: Env) -> None:
    over, gone, moved, replaced = (env.work / n for n in ("over.bin", "gone.bin", "moved.bin", "replaced.bin"))
    originals = {p: rand(20_000 + i) for i, p in enumerate((over, gone, moved, replaced))}
    for path, data in originals.items():
        path.write_bytes(data)
    over.chmod(0o640)
    tree = env.work / "tree"
    (tree / "deep").mkdir(parents=True)
    (tree / "deep" / "x.bin").write_bytes(tree_data := rand())
    (tree / "ln").symlink_to("deep/x.bin")
    ctx = env.approved

    ok(await env.call("write_file", ctx=ctx, file_path=str(over), content="text now", mode="overwrite"))
    ok(await env.call("write_file", ctx=ctx, file_path=str(over), content=" and more", mode="append"))
    ok(await env.call("delete_file", ctx=ctx, path=str(gone)))
    ok(await env.call("move_file", ctx=ctx, source=str(moved), destination=str(env.scratch / "moved.bin")))
    res = ok(await env.call("move_file", ctx=ctx, source=str(env.scratch / "moved.bin"), destination=str(replaced),
                            overwrite=True))
    assert res["replaced"] and replaced.read_bytes() == originals[moved]
    ok(await env.call("delete_file", ctx=ctx, path=str(tree), recursive=True))
    new = env.work / "n1" / "n2" / "new.txt"
    ok(await env.call("write_file", file_path=str(new), content="brand new", create_parents=True))
    assert not gone.exists() and not moved.exists() and not tree.exists() and new.exists()

    report = env.journal.restore("s1")
    assert all(r["ok"] for r in report), report
    for path, data in originals.items():
        assert path.read_bytes() == data, path
    assert stat.S_IMODE(over.stat().st_mode) == 0o640
    assert (tree / "deep" / "x.bin").read_bytes() == tree_data and os.readlink(tree / "ln") == "deep/x.bin"
    assert not (env.scratch / "moved.bin").exists()
    assert not (env.work / "n1").exists()  # the created file and the directories made for it are gone

    again = env.journal.restore("s1")
    assert {r["outcome"] for r in again} == {"already_restored"} and len(again) == len(report)
    for path, data in originals.items():
        assert path.read_bytes() == data


async def test_delete_of_a_symlink_removes_the_link_not_its_target(env: Env) -> None:
    target = env.work / "target.bin"
    target.write_bytes(data := rand())
    link = env.scratch / "link"
    link.symlink_to(target)
    res = ok(await env.call("delete_file", path=str(link)))
    assert res["type"] == "symlink" and not link.is_symlink() and target.read_bytes() == data
    env.journal.restore("s1")
    assert link.is_symlink() and link.resolve() == target.resolve()


async def test_delete_refusals(env: Env) -> None:
    d = env.scratch / "d"
    d.mkdir()
    (d / "f").write_text("x")
    failed(await env.call("delete_file", path=str(d)), "not empty", "recursive")
    failed(await env.call("delete_file", path=str(env.scratch / "nope")), "not found")
    failed(await env.call("delete_file", ctx=env.approved, path=str(env.root), recursive=True), "allowed root")
    (d / "f").unlink()
    ok(await env.call("delete_file", path=str(d)))  # an empty directory needs no `recursive`
    assert not d.exists()


async def test_move_refusals(env: Env) -> None:
    a, b = env.scratch / "a", env.scratch / "b"
    a.write_text("a")
    b.write_text("b")
    failed(await env.call("move_file", source=str(a), destination=str(b)), "destination exists", "overwrite")
    failed(await env.call("move_file", source=str(env.scratch / "nope"), destination=str(b)), "not found")
    failed(await env.call("move_file", source=str(a), destination=str(env.work)), "destination exists")
    failed(await env.call("move_file", source=str(a), destination=str(env.work), overwrite=True),
           "is a directory")
    failed(await env.call("move_file", source=str(env.scratch), destination=str(env.scratch / "in" / "x")),
           "into itself")
    failed(await env.call("move_file", source=str(a), destination=str(env.scratch / "no" / "x")),
           "does not exist")
    assert a.read_text() == "a" and b.read_text() == "b"


async def test_without_a_journal_changes_still_work_and_say_so(env: Env) -> None:
    ctx = replace(env.ctx, journal=None, session_id=None)
    res = ok(await env.call("write_file", ctx=ctx, file_path=str(env.scratch / "x"), content="x"))
    assert res["journaled"] is False
    res = ok(await env.call("delete_file", ctx=ctx, path=str(env.scratch / "x")))
    assert res["journaled"] is False


async def test_default_session_key(env: Env) -> None:
    ctx = replace(env.ctx, session_id=None)
    ok(await env.call("write_file", ctx=ctx, file_path=str(env.scratch / "y"), content="y"))
    assert [r["outcome"] for r in env.journal.restore("default")] == ["removed"]
    assert not (env.scratch / "y").exists()


def test_toolset_is_fresh_and_typed() -> None:
    first, second = files_toolset(), files_toolset()
    assert first is not second and first.specs is not second.specs
    types = {i.name: i.tool_type for i in first.infos()}
    assert types == {"read_file": "data_collection", "list_dir": "data_collection", "file_info": "data_collection",
                     "write_file": "action", "delete_file": "action", "move_file": "action"}


# ------------------------------------------------------------------------------------------ property

NAMES = ["a", "b", "sub/c", "sub", "ln"]
OPS = st.one_of(
    st.tuples(st.just("write_file"), st.sampled_from(NAMES), st.sampled_from(["create", "overwrite", "append"]),
              st.text(max_size=50)),
    st.tuples(st.just("delete_file"), st.sampled_from(NAMES)),
    st.tuples(st.just("move_file"), st.sampled_from(NAMES), st.sampled_from(NAMES), st.booleans()),
)


def snapshot(base: Path) -> dict[str, tuple[str, bytes | None, int]]:
    state = {}
    for path in sorted(base.rglob("*")):
        st_ = path.lstat()
        if stat.S_ISLNK(st_.st_mode):
            state[str(path.relative_to(base))] = ("link", os.readlink(path).encode(), 0)
            continue
        data = path.read_bytes() if path.is_file() else None
        state[str(path.relative_to(base))] = ("dir" if path.is_dir() else "file", data, stat.S_IMODE(st_.st_mode))
    return state


@settings(max_examples=60, deadline=None)
@given(initial=st.dictionaries(st.sampled_from(["a", "b", "sub/c"]), st.binary(max_size=300)),
       link=st.booleans(), ops=st.lists(OPS, max_size=8))
def test_any_sequence_of_changes_is_undone_exactly(initial: dict[str, bytes], link: bool,
                                                   ops: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "root"
        base.mkdir()
        for name, data in initial.items():
            (base / name).parent.mkdir(parents=True, exist_ok=True)
            (base / name).write_bytes(data)
        if link:
            (base / "ln").symlink_to("a")  # dangling unless "a" exists: both are fine
        before = snapshot(base)
        journal = UndoJournal(Path(tmp) / "state")
        ctx = ToolContext(policy=Policy(read_roots=[str(base)], write_roots=[str(base)]), journal=journal,
                          session_id="prop", approved_by="hypothesis", temp_dir=str(Path(tmp) / "elsewhere"))
        tools = files_toolset()

        async def run() -> None:
            for op in ops:
                if op[0] == "write_file":
                    args = {"file_path": str(base / op[1]), "mode": op[2], "content": op[3],
                            "create_parents": True}
                elif op[0] == "delete_file":
                    args = {"path": str(base / op[1]), "recursive": True}
                else:
                    args = {"source": str(base / op[1]), "destination": str(base / op[2]), "overwrite": op[3]}
                result = await tools.call(op[0], args, ctx)
                assert result.ok or "internal error" not in (result.error or ""), result.error

        asyncio.run(run())
        report = journal.restore("prop")
        assert all(r["ok"] for r in report), report
        assert snapshot(base) == before
