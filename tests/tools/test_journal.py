"""UndoJournal on its own: byte-exact restores, idempotence, crash tolerance, session ids."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from tether.tools.journal import UndoJournal


@pytest.fixture
def journal(tmp_path: Path) -> UndoJournal:
    return UndoJournal(tmp_path / "state")


@pytest.fixture
def work(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


def blob(n: int = 4096) -> bytes:
    return os.urandom(n) + b"\x00\xff"


@pytest.mark.parametrize("bad", ["", "..", "../x", "a/b", "a\\b", "/abs", ".hidden", "a..b", "-x", "a\x00b",
                                 "x" * 129])
def test_session_ids_that_could_escape_are_refused(journal: UndoJournal, work: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="invalid session id"):
        journal.record(bad, "write", work / "f")
    with pytest.raises(ValueError, match="invalid session id"):
        journal.restore(bad)


def test_overwrite_is_restored_byte_for_byte_with_mode_and_mtime(journal: UndoJournal, work: Path) -> None:
    f = work / "data.bin"
    original = blob(300_000)
    f.write_bytes(original)
    f.chmod(0o751)
    os.utime(f, ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    entry = journal.record("s1", "write", f)
    assert entry["kind"] == "file" and entry["size"] == len(original)
    f.write_bytes(b"changed")
    f.chmod(0o600)
    report = journal.restore("s1")
    assert [(r["path"], r["action"], r["outcome"]) for r in report] == [(str(f), "write", "restored")]
    assert f.read_bytes() == original
    assert stat.S_IMODE(f.stat().st_mode) == 0o751
    assert f.stat().st_mtime_ns == 1_600_000_000_123_456_789


def test_many_changes_are_undone_newest_first(journal: UndoJournal, work: Path) -> None:
    f = work / "f.bin"
    versions = [blob(100 + i) for i in range(4)]
    f.write_bytes(versions[0])
    for nxt in versions[1:]:
        journal.record("s1", "write", f)
        f.write_bytes(nxt)
    report = journal.restore("s1")
    assert len(report) == 3 and all(r["ok"] for r in report)
    assert f.read_bytes() == versions[0]


def test_created_file_is_removed_and_second_restore_does_nothing(journal: UndoJournal, work: Path) -> None:
    f = work / "new.txt"
    entry = journal.record("s1", "write", f)
    assert entry["kind"] == "created"
    f.write_text("hello")
    assert journal.restore("s1")[0]["outcome"] == "removed"
    assert not f.exists()
    f.write_text("made after the undo, not journaled")
    again = journal.restore("s1")
    assert [r["outcome"] for r in again] == ["already_restored"]
    assert f.read_text() == "made after the undo, not journaled"


def test_deleted_file_symlink_and_tree_come_back(journal: UndoJournal, work: Path) -> None:
    tree = work / "tree"
    (tree / "sub").mkdir(parents=True)
    files = {tree / "a.bin": blob(), tree / "sub" / "b.bin": blob(10_000)}
    for path, data in files.items():
        path.write_bytes(data)
    (tree / "sub").chmod(0o750)
    (tree / "link").symlink_to("a.bin")
    lone = work / "lone.bin"
    lone.write_bytes(blob())
    lone_data = lone.read_bytes()
    link = work / "alias"
    link.symlink_to(lone)
    journal.record("s1", "delete", tree)
    journal.record("s1", "delete", lone)
    journal.record("s1", "delete", link)
    shutil.rmtree(tree)
    lone.unlink()
    link.unlink()
    report = journal.restore("s1")
    assert [r["outcome"] for r in report] == ["restored"] * 3
    for path, data in files.items():
        assert path.read_bytes() == data
    assert os.readlink(tree / "link") == "a.bin"
    assert stat.S_IMODE((tree / "sub").stat().st_mode) == 0o750
    assert lone.read_bytes() == lone_data
    assert link.is_symlink() and os.readlink(link) == str(lone)


def test_move_is_moved_back_and_conflict_stays_pending(journal: UndoJournal, work: Path) -> None:
    src, dst = work / "src.bin", work / "dst.bin"
    data = blob()
    src.write_bytes(data)
    journal.record("s1", "move", src, dst)
    src.rename(dst)
    src.write_bytes(b"someone recreated the source")
    [row] = journal.restore("s1")
    assert not row["ok"] and row["outcome"].startswith("conflict")
    assert dst.read_bytes() == data  # nothing was clobbered
    src.unlink()
    [row] = journal.restore("s1")
    assert row["outcome"] == "moved_back"
    assert src.read_bytes() == data and not dst.exists()


def test_mkdir_is_removed_only_when_empty(journal: UndoJournal, work: Path) -> None:
    d = work / "made"
    journal.record("s1", "mkdir", d)
    d.mkdir()
    (d / "keep").write_text("x")
    [row] = journal.restore("s1")
    assert not row["ok"] and "not empty" in row["outcome"]
    (d / "keep").unlink()
    assert journal.restore("s1")[0]["outcome"] == "removed"
    assert not d.exists()


def test_corrupt_copy_is_refused_and_file_left_alone(journal: UndoJournal, work: Path, tmp_path: Path) -> None:
    f = work / "f"
    f.write_bytes(b"original")
    entry = journal.record("s1", "write", f)
    f.write_bytes(b"current")
    (tmp_path / "state" / "journal" / "s1" / "blobs" / entry["blob"]).write_bytes(b"tampered")
    [row] = journal.restore("s1")
    assert not row["ok"] and "corrupt" in row["outcome"]
    assert f.read_bytes() == b"current"
    assert not [p for p in work.iterdir() if p.name.startswith(".tether-undo")]


def test_index_is_append_only_and_survives_a_torn_line(journal: UndoJournal, work: Path, tmp_path: Path) -> None:
    f = work / "f"
    f.write_bytes(b"v0")
    journal.record("s1", "write", f)
    index = tmp_path / "state" / "journal" / "s1" / "entries.jsonl"
    with open(index, "ab") as fh:
        fh.write(b'{"id": "torn-by-a-cra')  # a crash in the middle of an append
    f.write_bytes(b"v1")
    reopened = UndoJournal(tmp_path / "state")
    assert reopened.restore("s1")[0]["outcome"] == "restored"
    assert f.read_bytes() == b"v0"
    assert reopened.restore("s1")[0]["outcome"] == "already_restored"  # the undo mark was not glued on
    lines = index.read_bytes().splitlines()
    assert json.loads(lines[0])["action"] == "write" and json.loads(lines[-1])["undone"]


def test_sessions_lists_counts_and_times(journal: UndoJournal, work: Path) -> None:
    assert journal.sessions() == []
    (work / "a").write_text("a")
    journal.record("s1", "write", work / "a")
    journal.record("s1", "write", work / "b")
    journal.record("s2", "write", work / "c")
    journal.restore("s2")
    rows = {r["session_id"]: r for r in journal.sessions()}
    assert rows["s1"]["entries"] == 2 and rows["s1"]["pending"] == 2 and rows["s1"]["restored"] == 0
    assert rows["s2"]["entries"] == 1 and rows["s2"]["pending"] == 0
    assert rows["s1"]["first_at"].endswith("Z") and rows["s1"]["last_at"] >= rows["s1"]["first_at"]


def test_unknown_session_restores_nothing(journal: UndoJournal) -> None:
    assert journal.restore("never-used") == []
    assert journal.entries("never-used") == []


def test_saved_copies_are_private(journal: UndoJournal, work: Path, tmp_path: Path) -> None:
    (work / "secret").write_text("token")
    entry = journal.record("s1", "write", work / "secret")
    session_dir = tmp_path / "state" / "journal" / "s1"
    assert stat.S_IMODE(session_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((session_dir / "blobs" / entry["blob"]).stat().st_mode) == 0o600


def test_bad_records_are_refused(journal: UndoJournal, work: Path) -> None:
    with pytest.raises(ValueError, match="unknown journal action"):
        journal.record("s1", "chmod", work / "x")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        journal.record("s1", "delete", work / "missing")
    with pytest.raises(ValueError, match="destination"):
        journal.record("s1", "move", work)


# ------------------------------------------------------------------------------------------ the jail
# An attacker who can write inside the roots plants a symlink after the change; the undo must not
# follow it out of the roots (issue 9, part 3). `outside` is where the link leads.


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    return path


def plant_link(directory: Path, target: Path) -> Path:
    """Move `directory` aside and leave a symlink to `target` in its place; returns where it went."""
    aside = directory.with_name(directory.name + ".aside")
    directory.rename(aside)
    directory.symlink_to(target)
    return aside


@pytest.mark.parametrize("roots", [None, "work"])
def test_created_file_under_a_planted_link_is_not_removed_outside(journal: UndoJournal, work: Path, outside: Path,
                                                                  roots: str | None) -> None:
    (work / "d").mkdir()
    journal.record("s1", "write", work / "d" / "id_rsa")
    (work / "d" / "id_rsa").write_text("made by the tool")
    plant_link(work / "d", outside)
    (outside / "id_rsa").write_text("the victim's key")
    [row] = journal.restore("s1", [str(work)] if roots else None)
    assert not row["ok"] and row["outcome"].startswith("conflict:") and "symlink" in row["outcome"]
    assert (outside / "id_rsa").read_text() == "the victim's key"


def test_a_link_planted_at_the_file_itself_is_replaced_not_written_through(journal: UndoJournal, work: Path,
                                                                          outside: Path) -> None:
    f = work / "f"
    f.write_bytes(b"original")
    journal.record("s1", "write", f)
    f.unlink()
    f.symlink_to(outside / "victim")
    (outside / "victim").write_bytes(b"theirs")
    [row] = journal.restore("s1", [str(work)])
    assert row["outcome"] == "restored"
    assert not f.is_symlink() and f.read_bytes() == b"original" and (outside / "victim").read_bytes() == b"theirs"


def test_move_back_refuses_a_planted_link_on_either_side(journal: UndoJournal, work: Path, outside: Path) -> None:
    (work / "a").mkdir()
    (work / "b").mkdir()
    src, dst = work / "a" / "f", work / "b" / "f"
    src.write_text("mine")
    journal.record("s1", "move", src, dst)
    src.rename(dst)
    (outside / "f").write_text("theirs")
    aside = plant_link(work / "b", outside)  # the undo would move outside/f into the roots
    [row] = journal.restore("s1", [str(work)])
    assert not row["ok"] and "symlink" in row["outcome"]
    assert (outside / "f").read_text() == "theirs" and not src.exists()
    (work / "b").unlink()
    aside.rename(work / "b")
    plant_link(work / "a", outside / "sub")  # ... or move it back to somewhere outside
    [row] = journal.restore("s1", [str(work)])
    assert not row["ok"] and "symlink" in row["outcome"] and dst.read_text() == "mine"
    assert sorted(p.name for p in outside.iterdir()) == ["f"]


def test_deleted_tree_is_not_merged_into_a_planted_link(journal: UndoJournal, work: Path, outside: Path) -> None:
    tree = work / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_text("mine")
    journal.record("s1", "delete", tree)
    shutil.rmtree(tree)
    tree.symlink_to(outside)  # where the tree was
    [row] = journal.restore("s1", [str(work)])
    assert not row["ok"] and row["outcome"].startswith("conflict")
    tree.unlink()
    tree.mkdir()
    (tree / "sub").symlink_to(outside)  # inside the tree that is merged into
    [row] = journal.restore("s1", [str(work)])
    assert not row["ok"] and "symlink" in row["outcome"]
    assert list(outside.iterdir()) == []
    (tree / "sub").unlink()
    assert journal.restore("s1", [str(work)])[0]["outcome"] == "restored"
    assert (tree / "sub" / "f").read_text() == "mine"


def test_a_change_outside_the_given_roots_is_refused(journal: UndoJournal, work: Path, outside: Path) -> None:
    f = outside / "f"
    f.write_text("original")
    journal.record("s1", "write", f)
    f.write_text("changed")
    [row] = journal.restore("s1", [str(work)])
    assert not row["ok"] and row["outcome"].startswith("refused:") and "write roots" in row["outcome"]
    assert f.read_text() == "changed"
    assert journal.restore("s1", [str(work), str(outside)])[0]["outcome"] == "restored"
    assert f.read_text() == "original"
