"""`layers_dir` with $TETHER_SANDBOX_LAYERS on real directories: made when missing under a safe parent, taken
when it is the user's own, and otherwise refused in one warning that names the variable, says why and which
directory is used instead, as an attacker on a shared machine would try it (a planted symlink, a directory of
theirs, a parent they can write to, a link or a directory of theirs anywhere on the path, swapped by a real
process running as another user, before, after and while the path is checked)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tether.tools.running.sandboxing import layers_dir

STRANGER = 65534  # nobody: another user's files (the suite runs as root in CI; chown needs it)


@pytest.fixture
def roots(tmp_path: Path) -> list[str]:
    work = tmp_path / "work"
    work.mkdir()
    return [str(work)]


def chosen(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, path: Path, roots: list[str]) -> str:
    monkeypatch.setenv("TETHER_SANDBOX_LAYERS", str(path))
    with caplog.at_level(logging.WARNING, logger="tether.tools.running.sandboxing"):
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
    warned(caplog, open_parent / "layers", f"{open_parent} can be changed by another user", fallback)
    assert not (open_parent / "layers").exists()

    caplog.clear()  # ... or any directory above it: ours below an open one can be renamed away just the same
    (open_parent / "ours").mkdir(mode=0o755)
    assert chosen(monkeypatch, caplog, open_parent / "ours" / "layers", roots) == fallback
    warned(caplog, open_parent / "ours" / "layers", f"{open_parent} can be changed by another user", fallback)
    assert not (open_parent / "ours" / "layers").exists()

    caplog.clear()  # a parent of theirs, even closed
    assert chosen(monkeypatch, caplog, theirs / "layers", roots) == fallback
    warned(caplog, theirs / "layers", f"{theirs} belongs to another user (uid {STRANGER})", fallback)
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
    warned(caplog, missing, f"{tmp_path / 'no'} cannot be used (No such file or directory)", fallback)
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


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory another user can reach (the test's tmp_path is root's, 0700): the machine's shared ground."""
    place = Path(tempfile.mkdtemp(prefix="tether-layers-test-", dir="/tmp"))
    place.chmod(0o755)
    yield place
    shutil.rmtree(place)


def as_stranger(act: Callable[[], None]) -> int:
    """`act` in a real process of another user, forked (the suite's interpreter may be out of their reach): the
    attacker. Result: its pid; it exits 0 when `act` returned, 1 when it raised."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(STRANGER)
            os.setuid(STRANGER)
            act()
            code = 0
        finally:
            os._exit(code)
    return pid


def attack(act: Callable[[], None]) -> None:
    assert os.waitpid(as_stranger(act), 0)[1] == 0


def swap(place: Path, gone: Path) -> None:
    """Rename the victim's directory away inside the attacker's, and put the attacker's own in its place."""
    place.rename(gone)
    (place / "layers").mkdir(parents=True, mode=0o777)


@pytest.mark.skipif(os.getuid() != 0, reason="another user's directories and processes need root")
def test_another_users_directory_or_link_anywhere_on_the_path_is_refused(
        shared: Path, roots: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A victim's own directory below one of the attacker's (a user-owned parent of a root-used path), reached
    directly or through a link the attacker planted in a sticky /tmp: the old check looked at the resolved
    parent alone (root's, closed) and took it; the attacker then renamed it away and put theirs in its place."""
    theirs = shared / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, STRANGER, STRANGER)
    inner = theirs / "inner"  # root's, closed, but in the attacker's hands: they can rename it
    inner.mkdir(mode=0o755)
    sticky = shared / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    attack(lambda: (sticky / "mid").symlink_to(inner))
    fallback = default(monkeypatch, roots)

    direct = inner / "layers"
    assert chosen(monkeypatch, caplog, direct, roots) == fallback
    warned(caplog, direct, f"{theirs} belongs to another user (uid {STRANGER}), who could swap what is below it",
           fallback)
    caplog.clear()
    through_link = sticky / "mid" / "layers"
    assert chosen(monkeypatch, caplog, through_link, roots) == fallback
    warned(caplog, through_link, f"{sticky / 'mid'} is a symlink", fallback)
    assert not direct.exists()  # nothing made where the attacker can swap it

    attack(lambda: swap(inner, theirs / "gone"))  # what they do next: both spellings now name their directory
    assert direct.stat().st_uid == through_link.stat().st_uid == STRANGER
    assert not os.listdir(theirs / "gone")


def flip(link: Path, target: Path, ready: int, stop: Path) -> None:
    """A link to the victim's directory in the attacker's hands, then a directory of theirs, over and over (each
    held for a few hundred look-ups of its own, so that a check meets each state often)."""
    os.write(ready, b"flipping")
    while not stop.exists():
        link.symlink_to(target)
        for _ in range(300):
            link.lstat()
        link.unlink()
        link.mkdir()
        for _ in range(300):
            link.lstat()
        link.rmdir()


@pytest.mark.skipif(os.getuid() != 0, reason="another user's directories and processes need root")
def test_a_component_flipped_while_it_is_checked_is_never_taken(
        shared: Path, roots: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The attacker flips a component between a link and a directory of theirs while the path is checked over
    and over: every state they can make is refused, whatever moment each check lands on."""
    theirs = shared / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, STRANGER, STRANGER)
    inner = theirs / "inner"
    inner.mkdir(mode=0o755)
    sticky = shared / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    fallback = default(monkeypatch, roots)
    stop = theirs / "stop"
    ready, told = os.pipe()
    pid = as_stranger(lambda: flip(sticky / "mid", inner, told, stop))
    os.close(told)
    try:
        assert os.read(ready, 8) == b"flipping"
        for _ in range(300):
            assert chosen(monkeypatch, caplog, sticky / "mid" / "layers", roots) == fallback
    finally:
        stop.touch()
        os.close(ready)
        assert os.waitpid(pid, 0)[1] == 0
    assert os.listdir(inner) == []
    reasons = {r.getMessage().split(" is not used: ")[1].split(";")[0] for r in caplog.records}
    assert reasons <= {f"{sticky / 'mid'} is a symlink (give the directory's own path, with no link on it)",
                       f"{sticky / 'mid'} belongs to another user (uid {STRANGER}), who could swap what is below it",
                       f"{sticky / 'mid'} cannot be used (No such file or directory)",
                       # a link swapped in between the look and the open: O_NOFOLLOW|O_DIRECTORY refuses it so
                       f"{sticky / 'mid'} cannot be used (Not a directory)"}, reasons
