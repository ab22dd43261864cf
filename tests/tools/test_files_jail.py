"""The file tools cannot be raced or linked out of the jail (issue 9, part 3), tried as an attacker would.

The race is made deterministic: the tool's check (`files._resolve`) is wrapped so that, right after
it has judged the path, the "attacker" swaps a directory (or the file) for a symlink that leads out
of the roots. Every test runs twice: with openat2 (when the kernel has it) and with the O_NOFOLLOW
walk used elsewhere.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from tests.kits.results import failed, ok
from tether.protocol.models import Result
from tether.sandbox.layers import fs
from tether.tools.context import ToolContext
from tether.tools.files import tool as files
from tether.tools.files.tool import files_toolset
from tether.tools.journal import UndoJournal
from tether.tools.policy.model import Policy


@pytest.fixture(params=["openat2", "walk"])
def opener(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "walk":
        monkeypatch.setattr(fs, "_openat2", lambda: None)
    return request.param


@dataclass
class Env:
    root: Path
    work: Path  # inside the roots, outside the temp dir
    scratch: Path  # the temp dir: changes go ahead without approval (but not through hard links)
    outside: Path  # outside the roots: nothing here may change
    journal: UndoJournal
    ctx: ToolContext

    async def call(self, name: str, ctx: ToolContext | None = None, **args: Any) -> Result:
        return await files_toolset().call(name, args, ctx or self.ctx)

    @property
    def approved(self) -> ToolContext:
        return replace(self.ctx, approved_by="alice")


@pytest.fixture
def env(tmp_path: Path, opener: str) -> Env:
    root, outside = tmp_path / "root", tmp_path / "outside"
    work, scratch = root / "work", root / "scratch"
    for d in (work, scratch, outside):
        d.mkdir(parents=True)
    journal = UndoJournal(tmp_path / "state")
    policy = Policy(read_roots=[str(root)], write_roots=[str(root)])
    ctx = ToolContext(policy=policy, journal=journal, session_id="s1", temp_dir=str(scratch))
    return Env(root, work, scratch, outside, journal, ctx)


def after_check(monkeypatch: pytest.MonkeyPatch, path: Path, plant: Callable[[], None]) -> list[bool]:
    """Run `plant` once, right after the tool's jail check of `path` has returned (the race window)."""
    original = files._resolve
    planted: list[bool] = []

    def racing(ctx: ToolContext, raw: str, *, write: bool, **more: Any) -> Path:
        resolved = original(ctx, raw, write=write, **more)
        if raw == str(path) and not planted:
            planted.append(True)
            plant()
        return resolved

    monkeypatch.setattr(files, "_resolve", racing)
    return planted


def after_all_checks(monkeypatch: pytest.MonkeyPatch, last_check: str, plant: Callable[[], None]) -> list[bool]:
    """Run `plant` once, right after `last_check` (the tool's last look before it changes anything) returns."""
    original = getattr(files, last_check)
    planted: list[bool] = []

    def racing(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if not planted:
            planted.append(True)
            plant()
        return result

    monkeypatch.setattr(files, last_check, racing)
    return planted


def swap_for_link(path: Path, target: Path) -> Callable[[], None]:
    """Move `path` aside and put a symlink to `target` in its place."""
    def plant() -> None:
        path.rename(path.with_name(path.name + ".aside"))
        path.symlink_to(target)
    return plant


def escaped(result: Result) -> str:
    error = failed(result, "path.escape", "symlink")
    assert result.result["rule"] == "path.escape"
    return error


# ------------------------------------------------------------------------------------------ fs itself


def test_open_beneath_follows_no_link_and_stays_inside(tmp_path: Path, opener: str) -> None:
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "f").write_text("inside")
    (tmp_path / "secret").write_text("outside")
    (root / "a" / "out").symlink_to(tmp_path)
    (root / "a" / "in").symlink_to("f")
    fd = fs.open_beneath(str(root), str(root / "a" / "f"), os.O_RDONLY)
    assert os.read(fd, 100) == b"inside"
    os.close(fd)
    fd = fs.open_beneath(str(root), "a/f", os.O_RDONLY)  # relative to the root works the same
    os.close(fd)
    for path in ("a/out/secret", "a/in", str(tmp_path / "secret"), "a/../a/f", "a/out"):
        with pytest.raises(fs.EscapeError) as caught:
            fs.open_beneath(str(root), path, os.O_RDONLY)
        assert path in str(caught.value)
    with pytest.raises(fs.EscapeError, match="symlink"):
        fs.open_beneath(str(root), "a/out", os.O_RDONLY | os.O_DIRECTORY)
    with pytest.raises(NotADirectoryError):
        fs.open_beneath(str(root), "a/f/x", os.O_RDONLY)
    with pytest.raises(FileNotFoundError):
        fs.open_beneath(str(root), "a/nope", os.O_RDONLY)
    fd = fs.open_beneath(str(root), "a/new", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    os.close(fd)
    assert (root / "a" / "new").stat().st_mode & 0o777 == 0o640 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_parent_beneath_creates_directories_but_never_through_a_link(tmp_path: Path, opener: str) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    fd, name = fs.parent_beneath(str(root), str(root / "x" / "y" / "f"), create=True)
    try:
        assert name == "f" and os.listdir(fd) == []
    finally:
        os.close(fd)
    assert (root / "x" / "y").is_dir()
    with pytest.raises(fs.EscapeError, match="symlink"):
        fs.parent_beneath(str(root), str(root / "link" / "deeper" / "f"), create=True)
    assert list(outside.iterdir()) == []  # nothing was made through the link
    with pytest.raises(fs.EscapeError, match="root"):
        fs.parent_beneath(str(root), str(root))
    with pytest.raises(FileNotFoundError):
        fs.parent_beneath(str(root), str(root / "missing" / "f"))


def test_the_root_itself_swapped_for_a_link_is_refused(tmp_path: Path, opener: str) -> None:
    root = tmp_path / "root"
    root.symlink_to(tmp_path)
    with pytest.raises(fs.EscapeError, match="root"):
        fs.open_beneath(str(root), "x", os.O_RDONLY)


def test_copy_entry_replaces_a_link_at_the_destination_instead_of_writing_through_it(tmp_path: Path) -> None:
    src, dst, outside = tmp_path / "src", tmp_path / "dst", tmp_path / "outside"
    for d in (src, dst, outside):
        d.mkdir()
    (src / "tree" / "sub").mkdir(parents=True)
    (src / "tree" / "sub" / "f").write_bytes(b"data")
    (src / "tree" / "ln").symlink_to("sub/f")
    (outside / "victim").write_text("keep")
    (dst / "tree").mkdir()
    (dst / "tree" / "ln").symlink_to(outside / "victim")
    (dst / "tree" / "sub").symlink_to(outside)
    sfd, dfd = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDONLY)
    try:
        with pytest.raises(fs.EscapeError):  # a link where a directory should be merged into
            fs.copy_entry(sfd, "tree", dfd, "tree", merge=True)
        (dst / "tree" / "sub").unlink()
        fs.copy_entry(sfd, "tree", dfd, "tree", merge=True)
    finally:
        os.close(sfd)
        os.close(dfd)
    assert (outside / "victim").read_text() == "keep" and sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert os.readlink(dst / "tree" / "ln") == "sub/f" and (dst / "tree" / "sub" / "f").read_bytes() == b"data"


def test_move_entry_across_filesystems_copies_then_removes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "tree").mkdir(parents=True)
    (a / "tree" / "f").write_bytes(b"x" * 10)
    b.mkdir()
    rename = os.rename
    calls: list[bool] = []

    def cross_device(src: Any, dst: Any, **kw: Any) -> None:
        if not calls:  # the first rename is the move itself: pretend b is another filesystem
            calls.append(True)
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        rename(src, dst, **kw)

    monkeypatch.setattr(os, "rename", cross_device)
    afd, bfd = os.open(a, os.O_RDONLY), os.open(b, os.O_RDONLY)
    try:
        fs.move_entry(afd, "tree", bfd, "moved")
    finally:
        os.close(afd)
        os.close(bfd)
    assert not (a / "tree").exists() and (b / "moved" / "f").read_bytes() == b"x" * 10


# ------------------------------------------------------------------------------------------ races


async def test_read_refuses_a_directory_swapped_for_a_link_after_the_check(env: Env, monkeypatch) -> None:
    (env.work / "d").mkdir()
    (env.work / "d" / "notes.txt").write_text("harmless")
    (env.outside / "notes.txt").write_text("TOP SECRET")
    path = env.work / "d" / "notes.txt"
    planted = after_check(monkeypatch, path, swap_for_link(env.work / "d", env.outside))
    error = escaped(await env.call("read_file", file_path=str(path)))
    assert planted and "TOP SECRET" not in error


async def test_read_refuses_the_file_itself_swapped_for_a_link(env: Env, monkeypatch) -> None:
    path = env.work / "notes.txt"
    path.write_text("harmless")
    (env.outside / "secret").write_text("TOP SECRET")
    after_check(monkeypatch, path, swap_for_link(path, env.outside / "secret"))
    escaped(await env.call("read_file", file_path=str(path)))


async def test_list_refuses_a_directory_swapped_for_a_link(env: Env, monkeypatch) -> None:
    (env.work / "d").mkdir()
    (env.outside / "id_rsa").write_text("key")
    after_check(monkeypatch, env.work / "d", swap_for_link(env.work / "d", env.outside))
    error = escaped(await env.call("list_dir", path=str(env.work / "d")))
    assert "id_rsa" not in error


async def test_file_info_refuses_a_directory_swapped_for_a_link(env: Env, monkeypatch) -> None:
    (env.work / "d").mkdir()
    (env.work / "d" / "f").write_text("x")
    (env.outside / "f").write_text("outside")
    after_check(monkeypatch, env.work / "d" / "f", swap_for_link(env.work / "d", env.outside))
    escaped(await env.call("file_info", path=str(env.work / "d" / "f")))


async def test_overwrite_refuses_a_parent_swapped_for_a_link(env: Env, monkeypatch) -> None:
    (env.work / "conf").mkdir()
    path = env.work / "conf" / "bashrc"
    path.write_text("mine")
    victim = env.outside / "bashrc"
    victim.write_text("theirs")
    planted = after_all_checks(monkeypatch, "_missing_parents", swap_for_link(env.work / "conf", env.outside))
    escaped(await env.call("write_file", ctx=env.approved, file_path=str(path), content="evil", mode="overwrite"))
    assert planted and victim.read_text() == "theirs"


async def test_overwrite_refuses_the_file_swapped_for_a_link(env: Env, monkeypatch) -> None:
    path = env.scratch / "out.txt"
    path.write_text("mine")
    victim = env.outside / "victim"
    victim.write_text("theirs")
    planted = after_all_checks(monkeypatch, "_missing_parents", swap_for_link(path, victim))
    escaped(await env.call("write_file", file_path=str(path), content="evil", mode="overwrite"))
    assert planted and victim.read_text() == "theirs"


async def test_create_with_parents_refuses_a_link_planted_where_a_parent_will_be(env: Env, monkeypatch) -> None:
    path = env.scratch / "new" / "deeper" / "f.txt"

    def plant() -> None:
        (env.scratch / "new").symlink_to(env.outside)

    planted = after_all_checks(monkeypatch, "_missing_parents", plant)
    escaped(await env.call("write_file", file_path=str(path), content="x", create_parents=True))
    assert planted and list(env.outside.iterdir()) == []


async def test_delete_refuses_a_parent_swapped_for_a_link(env: Env, monkeypatch) -> None:
    (env.scratch / "d").mkdir()
    path = env.scratch / "d" / "f"
    path.write_text("mine")
    victim = env.outside / "f"
    victim.write_text("theirs")
    planted = after_all_checks(monkeypatch, "_require_approval", swap_for_link(env.scratch / "d", env.outside))
    escaped(await env.call("delete_file", path=str(path)))
    assert planted and victim.read_text() == "theirs"


async def test_move_refuses_a_destination_directory_swapped_for_a_link(env: Env, monkeypatch) -> None:
    src = env.scratch / "payload"
    src.write_text("evil")
    (env.scratch / "dest").mkdir()
    dst = env.scratch / "dest" / "authorized_keys"
    planted = after_all_checks(monkeypatch, "_require_approval", swap_for_link(env.scratch / "dest", env.outside))
    escaped(await env.call("move_file", source=str(src), destination=str(dst)))
    assert planted and list(env.outside.iterdir()) == [] and src.read_text() == "evil"


async def test_nothing_was_raced_when_nothing_was_planted(env: Env) -> None:
    """The same calls without an attacker still work (the jail does not get in the way)."""
    (env.scratch / "d").mkdir()
    ok(await env.call("write_file", file_path=str(env.scratch / "d" / "f"), content="one"))
    ok(await env.call("write_file", file_path=str(env.scratch / "d" / "f"), content="two", mode="overwrite"))
    assert ok(await env.call("read_file", file_path=str(env.scratch / "d" / "f")))["content"] == "two"
    assert [e["name"] for e in ok(await env.call("list_dir", path=str(env.scratch / "d")))["entries"]] == ["f"]
    ok(await env.call("move_file", source=str(env.scratch / "d" / "f"), destination=str(env.scratch / "g")))
    ok(await env.call("delete_file", path=str(env.scratch / "g")))
    assert list(env.scratch.iterdir()) == [env.scratch / "d"]


# ------------------------------------------------------------------------------------------ hard links


async def test_write_to_a_hard_link_of_a_file_outside_needs_approval_even_in_temp(env: Env) -> None:
    victim = env.outside / "passwd"
    victim.write_text("root:x:0:0\n")
    link = env.scratch / "innocent.txt"
    os.link(victim, link)
    for mode in ("overwrite", "append"):
        result = await env.call("write_file", file_path=str(link), content="evil::0:0\n", mode=mode)
        failed(result, "needs approval", "approval.hardlink", "2 hard links")
        assert result.result["rule"] == "approval.hardlink"
    assert victim.read_text() == "root:x:0:0\n"


async def test_write_to_a_hard_linked_file_inside_needs_approval_and_is_undoable(env: Env) -> None:
    a, b = env.scratch / "a.txt", env.scratch / "b.txt"
    a.write_text("shared")
    os.link(a, b)
    failed(await env.call("write_file", file_path=str(a), content="changed", mode="overwrite"), "approval.hardlink")
    assert b.read_text() == "shared"
    ok(await env.call("write_file", ctx=env.approved, file_path=str(a), content="changed", mode="overwrite"))
    assert b.read_text() == "changed"  # what the person approved: the file under both names
    [row] = env.journal.restore("s1", [str(env.root)])
    assert row["ok"] and a.read_text() == "shared"


async def test_a_hard_link_made_after_the_check_is_caught_on_the_open_file(env: Env, monkeypatch) -> None:
    path = env.scratch / "notes.txt"
    path.write_text("one link")
    victim = env.outside / "victim"
    victim.write_text("theirs")

    def plant() -> None:
        path.unlink()
        os.link(victim, path)

    after_all_checks(monkeypatch, "_missing_parents", plant)
    failed(await env.call("write_file", file_path=str(path), content="evil", mode="overwrite"), "approval.hardlink")
    assert victim.read_text() == "theirs"
    assert env.journal.entries("s1") == []  # refused before anything was journaled


async def test_deleting_or_replacing_a_hard_link_touches_only_the_name(env: Env) -> None:
    victim = env.outside / "victim"
    victim.write_text("theirs")
    link = env.scratch / "link"
    os.link(victim, link)
    ok(await env.call("delete_file", path=str(link)))
    os.link(victim, link)
    (env.scratch / "new").write_text("mine")
    ok(await env.call("move_file", source=str(env.scratch / "new"), destination=str(link), overwrite=True))
    assert victim.read_text() == "theirs" and link.read_text() == "mine"


# ------------------------------------------------------------------------------------------ undo


async def test_undo_does_not_follow_a_link_planted_in_a_parent_after_the_write(env: Env) -> None:
    (env.scratch / "cfg").mkdir()
    path = env.scratch / "cfg" / "profile"
    path.write_text("original")
    ok(await env.call("write_file", file_path=str(path), content="changed", mode="overwrite"))
    (env.scratch / "cfg").rename(env.scratch / "cfg.aside")
    (env.scratch / "cfg").symlink_to(env.outside)  # an undo would now write to outside/profile
    for roots in ([str(env.root)], None):
        [row] = env.journal.restore("s1", roots)
        assert not row["ok"] and row["outcome"].startswith("conflict:") and "symlink" in row["outcome"]
    assert list(env.outside.iterdir()) == []
    (env.scratch / "cfg").unlink()
    (env.scratch / "cfg.aside").rename(env.scratch / "cfg")
    [row] = env.journal.restore("s1", [str(env.root)])  # the conflict stayed pending: it goes back now
    assert row["outcome"] == "restored" and path.read_text() == "original"


def test_cli_undo_uses_the_policy_write_roots(tmp_path: Path) -> None:
    state, work, other = tmp_path / "state", tmp_path / "work", tmp_path / "other"
    work.mkdir()
    other.mkdir()
    journal = UndoJournal(state)
    for d in (work, other):
        journal.record("cli", "write", d / "new.txt")
        (d / "new.txt").write_text("made")
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"write_roots: [{str(work)!r}]\nread_roots: [{str(work)!r}]\n")
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "300"}
    done = subprocess.run([sys.executable, "-m", "tether.cli", "undo", "cli", "--json", "--local",
                           "--state-dir", str(state), "--policy", str(policy)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert not (work / "new.txt").exists() and (other / "new.txt").exists()
    assert "outside the write roots" in done.stdout
