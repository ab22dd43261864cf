"""Hints that tell the truth (issue 32): after a held action, only arguments the tool has; 'the command does
not run again' only when it ran; the undo hint only after a task that journaled a change."""

from __future__ import annotations

from pathlib import Path

from tether.cli.commands.fleet.exec_run import held_hint
from tether.cli.commands.tasks.run import _journaled
from tether.cli.common import unreachable_hint
from tether.protocol.models import Result
from tether.tools.journal import UndoJournal

HELD = {"needs_approval": True, "rule": "protected"}
CAPTURED = {**HELD, "changes": [{"kind": "modified", "path": "/etc/x"}], "changes_digest": "d"}
SHELL_RUN = {"properties": {"cmd": {}, "argv": {}, "preview": {"type": "boolean"}}}
DELETE_FILE = {"properties": {"path": {}, "recursive": {}}}


def test_a_held_delete_file_names_no_preview_and_no_rerun() -> None:
    hint = held_hint(Result.failure("needs approval", "c1", result=HELD), DELETE_FILE, "s1")
    assert hint is not None and "--approve" in hint
    assert "preview" not in hint and "does not run again" not in hint


def test_held_changes_of_a_command_that_ran() -> None:
    hint = held_hint(Result.failure("needs approval", "c1", result=CAPTURED), SHELL_RUN, "s1")
    assert hint is not None and "does not run again" in hint and "--session s1" in hint and "preview=true" in hint
    no_preview = held_hint(Result.failure("needs approval", "c1", result=CAPTURED), {"properties": {}}, "s1")
    assert no_preview is not None and "preview" not in no_preview


def test_no_hint_for_a_result_not_held() -> None:
    assert held_hint(Result.failure("boom", "c1"), SHELL_RUN, "s1") is None


def test_the_undo_hint_needs_a_journaled_change(tmp_path: Path) -> None:
    assert not _journaled(tmp_path, "s-nothing")
    target = tmp_path / "f.txt"
    target.write_text("before")
    UndoJournal(tmp_path).record("s-changed", "write", target)
    assert _journaled(tmp_path, "s-changed")


def test_unreachable_hints_say_why() -> None:
    assert "is it running" in unreachable_hint("[Errno 111] Connection refused")
    assert "scheme" in unreachable_hint("Request URL is missing an 'http://' or 'https://' protocol.")
    tls = unreachable_hint("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    assert "TLS" in tls and "is it running" not in tls
    assert "is it running" not in unreachable_hint("[Errno -2] Name or service not known")
