"""What an approval's digest covers (tools/policy/approval.py, issue 27 item 2), on real files: it moves with the
arguments, the script a command names and the program it runs, and stays put for what reads differently
every time (/proc); a command naming many large files is not read whole."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tether.tools.policy import approval


def facts(tmp_path: Path, **params: object) -> str:
    return approval.command_facts("shell.run", {"cwd": str(tmp_path), **params})


def test_the_digest_moves_with_the_arguments_the_script_and_the_program(tmp_path: Path) -> None:
    script = tmp_path / "tidy.sh"
    script.write_text("echo tidy\n")
    first = facts(tmp_path, cmd="sh", argv=["tidy.sh"])
    assert first == facts(tmp_path, cmd="sh", argv=["tidy.sh"]) and first.startswith("sha256:")
    assert first != facts(tmp_path, cmd="sh", argv=["tidy.sh", "-x"])  # argv
    assert first != facts(tmp_path, cmd="sh", argv=["tidy.sh"], env={"A": "1"})  # env
    script.write_text("rm -rf ~\n")
    assert first != facts(tmp_path, cmd="sh", argv=["tidy.sh"])  # the script's bytes
    # the program `cmd` resolves to: the same name, other bytes
    tool = tmp_path / "tool"
    shutil.copy(shutil.which("true") or "/bin/true", tool)
    before = facts(tmp_path, cmd="./tool")
    with open(tool, "ab") as f:
        f.write(b"\0")
    assert before != facts(tmp_path, cmd="./tool")


def test_kernel_files_are_named_not_read_and_large_files_are_not_read_whole(tmp_path: Path) -> None:
    # /proc/sys/kernel/random/uuid reads differently every time: named by its path, the digest is stable
    assert facts(tmp_path, cmd="cat", argv=["/proc/sys/kernel/random/uuid"]) == \
        facts(tmp_path, cmd="cat", argv=["/proc/sys/kernel/random/uuid"])
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(approval.MAX_HASHED_BYTES + 1)
    shown = approval.file_identity(str(big))
    assert shown is not None and "sha256" not in shown and shown["size"] == approval.MAX_HASHED_BYTES + 1
    first = facts(tmp_path, cmd="rm", argv=["big"])
    os.utime(big, ns=(1, 1))  # another file there now, for all the digest can tell
    assert first != facts(tmp_path, cmd="rm", argv=["big"])


def test_held_changes_and_the_command_combine_into_one_digest(tmp_path: Path) -> None:
    command = facts(tmp_path, cmd="cp", argv=["a", "b"])
    claim = approval.ApprovalClaim("api:alice", approval.combine(command, "sha256:held"), command)
    assert claim.matches("sha256:held") and not claim.matches("sha256:other") and not claim.matches(None)
    assert approval.combine(command, None) == command
