"""`layers_dir` with $TETHER_SANDBOX_LAYERS on real directories: made when missing under a safe parent, taken
when it is the user's own, and otherwise refused in one warning that names the variable, says why and which
directory is used instead, as an attacker on a shared machine would try it (a planted symlink, a directory of
theirs, a parent they can write to)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from tether.tools.sandboxing import layers_dir

STRANGER = 65534  # nobody: another user's files (the suite runs as root in CI; chown needs it)


@pytest.fixture
def roots(tmp_path: Path) -> list[str]:
    work = tmp_path / "work"
    work.mkdir()
    return [str(work)]


def chosen(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, path: Path, roots: list[str]) -> str:
    monkeypatch.setenv("TETHER_SANDBOX_LAYERS", str(path))
    with caplog.at_level(logging.WARNING, logger="tether.tools.sandboxing"):
        got = layers_dir(roots)
    assert got is not None
    return got


def default(monkeypatch: pytest.MonkeyPatch, roots: list[str]) -> str:
    """Where the layers go without the variable."""
    monkeypatch.delenv("TETHER_SANDBOX_LAYERS", raising=False)
    got = layers_dir(roots)
    assert got is not None
    return got


def warned(caplog: pytest.LogCaptureFixture, path: Path, why: str, used: str) -> None:
    [line] = [r.getMessage() for r in caplog.records if "TETHER_SANDBOX_LAYERS" in r.getMessage()]
    assert line.startswith(f"TETHER_SANDBOX_LAYERS={path} is not used: ") and why in line, line
    assert line.endswith(f"the sandbox's layers go to {used} instead") and "\n" not in line, line


def test_a_missing_directory_is_made_private_and_an_own_one_is_taken(
        tmp_path: Path, roots: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    made = tmp_path / "layers"
    assert chosen(monkeypatch, caplog, made, roots) == str(made)
    found = made.lstat()
    assert stat.S_ISDIR(found.st_mode) and stat.S_IMODE(found.st_mode) == 0o700 and found.st_uid == os.getuid()
    made.chmod(0o755)  # the user's own, too open: taken, and closed again
    (made / "left").write_text("x")
    assert chosen(monkeypatch, caplog, made, roots) == str(made)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700 and (made / "left").exists()
    assert not [r for r in caplog.records if "TETHER_SANDBOX_LAYERS" in r.getMessage()]


@pytest.mark.skipif(os.getuid() != 0, reason="another user's directory is made with chown, as root")
def test_what_an_attacker_plants_is_refused_aloud(
        tmp_path: Path, roots: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o777)
    os.chown(theirs, STRANGER, STRANGER)
    fallback = default(monkeypatch, roots)
    assert not fallback.startswith(str(tmp_path))

    link = tmp_path / "link"  # a symlink in the name's place (to a directory they own)
    link.symlink_to(theirs)
    assert chosen(monkeypatch, caplog, link, roots) == fallback
    warned(caplog, link, f"{link} is a symlink", fallback)
    assert os.listdir(theirs) == []

    caplog.clear()  # their own directory under the name
    assert chosen(monkeypatch, caplog, theirs, roots) == fallback
    warned(caplog, theirs, f"{theirs} belongs to another user (uid {STRANGER})", fallback)
    assert theirs.stat().st_uid == STRANGER and stat.S_IMODE(theirs.stat().st_mode) == 0o777

    caplog.clear()  # a parent they can write to (not sticky): they could rename ours away and put theirs there
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    assert chosen(monkeypatch, caplog, open_parent / "layers", roots) == fallback
    warned(caplog, open_parent / "layers", f"its parent {open_parent} can be changed by another user", fallback)
    assert not (open_parent / "layers").exists()

    caplog.clear()  # a parent of theirs, even closed
    assert chosen(monkeypatch, caplog, theirs / "layers", roots) == fallback
    warned(caplog, theirs / "layers", f"its parent {theirs} can be changed by another user", fallback)
    assert not (theirs / "layers").exists()


def test_a_sticky_parent_is_safe_and_a_missing_one_or_a_root_is_said(
        tmp_path: Path, roots: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    sticky = tmp_path / "sticky"  # as /tmp and /dev/shm are: nobody can rename or remove another's entry
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert chosen(monkeypatch, caplog, sticky / "layers", roots) == str(sticky / "layers")
    fallback = default(monkeypatch, roots)

    caplog.clear()
    missing = tmp_path / "no" / "such" / "layers"  # never made with its parents: a typo is said, not built
    assert chosen(monkeypatch, caplog, missing, roots) == fallback
    warned(caplog, missing, f"its parent {missing.parent} cannot be used", fallback)
    assert not missing.parent.exists()

    caplog.clear()
    inside = Path(roots[0]) / "layers"  # inside a write root: an overlay may not hold its own layers
    assert chosen(monkeypatch, caplog, inside, roots) == fallback
    warned(caplog, inside, f"inside the write root {roots[0]}", fallback)
    assert not inside.exists()

    caplog.clear()
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert chosen(monkeypatch, caplog, a_file, roots) == fallback
    warned(caplog, a_file, f"{a_file} is not a directory", fallback)
