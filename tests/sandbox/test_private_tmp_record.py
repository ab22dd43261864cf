"""Each device records its sessions' private /tmp base in its own state directory (`tether.sandbox.tmp_record`):
two devices of one user (one temp dir, one layers directory) never find or overwrite each other's base, a
restarted one finds its own again, and a record that is a link, another user's, names another living device's
base, or anything but a base of this user in the temp dir, is never followed: a new base is made instead.

Real directories and files; the device's base-keeping (`PrivateTmp`) as a device runs it, without a sandbox."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tether.sandbox.private_tmp import PrivateTmp
from tether.sandbox.tmp_record import RECORD


@pytest.fixture
def temp(tmp_path: Path) -> Path:
    path = tmp_path / "temp"
    path.mkdir(mode=0o1777)
    path.chmod(0o1777)  # a machine's /tmp: sticky, everyone's
    return path


def test_two_devices_of_one_user_keep_their_own_base_across_restarts(temp: Path, tmp_path: Path) -> None:
    state_a, state_b = tmp_path / "state-a", tmp_path / "state-b"
    a, b = PrivateTmp(str(temp), state_a), PrivateTmp(str(temp), state_b)
    a_dir, b_dir = a.dir_of("same"), b.dir_of("same")  # one session name on both devices
    assert a.base != b.base and a_dir != b_dir
    Path(a_dir, "note").write_text("a's")
    assert (state_a / RECORD).read_text().strip() == a.base and (state_b / RECORD).read_text().strip() == b.base
    assert not a.foreign("same", a_dir) and a.foreign("same", os.path.join(a.base, "x"))
    old_a, old_b = a.base, b.base
    assert not a.close() and not b.close()  # a session lives in each: both bases stay
    again_b = PrivateTmp(str(temp), state_b)  # B restarts first: it finds its own base, not A's
    again_a = PrivateTmp(str(temp), state_a)
    assert again_b.base == old_b and again_a.base == old_a
    assert Path(again_a.dir_of("same"), "note").read_text() == "a's"
    assert not Path(again_b.dir_of("same"), "note").exists()
    again_a.remove("same")
    assert again_a.close() and not (state_a / RECORD).exists()  # its base went empty: so do base and record
    assert (state_b / RECORD).read_text().strip() == old_b
    again_b.close()


def test_no_state_directory_no_record(temp: Path, tmp_path: Path) -> None:
    first = PrivateTmp(str(temp), None)
    first.dir_of("s")
    second = PrivateTmp(str(temp), None)  # nothing to find it by: a base of its own
    assert second.base != first.base
    first.close(), second.close()


@pytest.mark.parametrize("planted", ["link to b's record", "names b's base", "names living b's base",
                                     "outside the temp dir", "dot-dot", "group-writable", "not a file", "huge"])
def test_a_planted_record_is_never_followed(temp: Path, tmp_path: Path, planted: str) -> None:
    state_a, state_b = tmp_path / "state-a", tmp_path / "state-b"
    b = PrivateTmp(str(temp), state_b)
    Path(b.dir_of("same"), "secret").write_text("b's")
    elsewhere = tmp_path / f".tether-tmp-{os.getuid()}-elsewhere"
    elsewhere.mkdir(mode=0o700)
    state_a.mkdir()
    record = state_a / RECORD
    if planted == "link to b's record":
        record.symlink_to(state_b / RECORD)
    elif planted == "names b's base":  # written as the attacker would, but a file another user may change
        record.write_text(b.base + "\n")
        record.chmod(0o666)
    elif planted == "names living b's base":  # a record as the device writes it, naming a base B holds
        record.write_text(b.base + "\n")
        record.chmod(0o600)
    elif planted == "outside the temp dir":
        record.write_text(f"{elsewhere}\n")
    elif planted == "dot-dot":
        record.write_text(f"{temp}/.tether-tmp-{os.getuid()}-x/../{os.path.basename(b.base)}\n")
    elif planted == "group-writable":  # the record is fine, the directory holding it is not the user's alone
        record.write_text(b.base + "\n")
        record.chmod(0o600)
        state_a.chmod(0o770)
    elif planted == "not a file":
        os.mkfifo(record, 0o600)  # a reader that opened it without O_NONBLOCK would hang here
    else:
        record.write_text(b.base + "/" * 5000 + "\n")
    a = PrivateTmp(str(temp), state_a)
    assert a.base != b.base and a.base.startswith(f"{temp}/")
    assert not Path(a.dir_of("same"), "secret").exists()
    assert not a.foreign("same", os.path.join(a.dir_of("same"), "x"))
    a.remove("same"), a.close(), b.close()


def test_a_state_directory_others_may_write_is_said_once(temp: Path, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o777)
    state.chmod(0o777)
    private = PrivateTmp(str(temp), state)
    for _ in range(5):  # every file tool's look before the first command
        assert not private.foreign("s", str(temp / "x"))
    private.dir_of("s")
    assert not (state / RECORD).exists()  # not recorded where others could change it
    said = [r.getMessage() for r in caplog.records if "not this user's alone" in r.getMessage()]
    assert len(said) == 1, said
    private.remove("s"), private.close()
