"""Issue 26, item 6 (and item 4's capture part): a sandboxed command's layer at the edges, tried as an
attacker would, on a real device served as a server serves it (its `BatchRunner` running sessions side
by side, every result encoded into the frame the server would read), with real bubblewrap, real files
and the real journal.

- one command making many files must not stall the other sessions: capture and apply run on the
  sandbox's worker pool, so another session's commands keep answering *while* they run;
- a 1-byte append to a 2 GiB sparse file stays sparse: in the layer, when applied, in the journal,
  and when undone;
- a file name that is not UTF-8 gives a clear result at once (escaped), and undo works;
- an apply never undoes what another session did meanwhile (both orders): a conflict, nothing applied;
- a command over `limits.layer_files` / `limits.layer_bytes` fails naming the limit and applies nothing.

The files live in the temp dir (where creating and deleting need no approval), under a fresh directory per
test that the policy names as a write root (the machine's, captured, beside each session's private /tmp).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tether.device.link.batch_runner import BatchRunner
from tether.device.link.finished import FinishedRecord
from tether.device.link.outbox import Outbox, results_frame
from tether.device.local import LocalDevice, build_device
from tether.protocol.codec import decode_client_message
from tether.protocol.messages import ClientMessageType, ServerMessage, ServerMessageType
from tether.protocol.models import Command, Result, ResultStatus
from tether.tools.journal import UndoJournal
from tether.tools.policy.model import policy_from_mapping
from tether.tools.shell import capture as shell_capture

BWRAP_INSTALL = "apt-get install -y bubblewrap"
SYSTEM_PYTHON = "/usr/bin/python3"
MANY = 20_000  # the bench (bench/capture_stall.py) makes 100,000
SMALL = 16 << 20  # "stays sparse": what a 2 GiB file with a few bytes of data may take on disk (overlayfs
# copies up in 1 MiB steps, so the stretch around the data is copied whole)
GATE_S = 60.0  # how long a gated worker waits for the other session before failing the test

MAKE_FILES = """
import os, sys
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
for i in range(int(sys.argv[2])):
    open(os.path.join(d, "f%06d" % i), "w").close()  # empty: what is measured is files, not bytes
"""
APPEND = """
import sys
with open(sys.argv[1], "ab") as f:
    f.write(b"Z")
"""
POKE = """
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(int(sys.argv[2]))
    f.write(b"P")
"""
NON_UTF8 = """
import os, sys
d = os.fsencode(sys.argv[1])
with open(d + b"/new-\\xff\\xfe.txt", "wb") as f:
    f.write(b"made by the command")
with open(d + b"/old-\\xe9.txt", "wb") as f:
    f.write(b"changed by the command")
print("done")
"""
RMTREE = """
import shutil, sys
shutil.rmtree(sys.argv[1])
"""
CREATE = """
import sys
with open(sys.argv[1], "w") as f:
    f.write(sys.argv[2])
"""
WRITE_BYTES = """
import sys
with open(sys.argv[1], "wb") as f:
    f.write(b"y" * int(sys.argv[2]))
"""


@pytest.fixture(autouse=True)
def _tools() -> None:
    if shutil.which("bwrap") is None:
        pytest.fail(f"bwrap is not installed; install it with: {BWRAP_INSTALL}")
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.fail(f"{SYSTEM_PYTHON} is missing; install it with: apt-get install -y python3")


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch) -> Any:
    path = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-capture-home-")).resolve()
    monkeypatch.setenv("HOME", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def scratch() -> Any:
    """A fresh directory in the temp dir (a write root)."""
    path = Path(tempfile.mkdtemp(prefix="tether-capture-")).resolve()
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Box:
    """A device served as by a server: commands go in as COMMAND batches, results come back as the frames
    the device would send (decoded and validated here as the server does)."""

    def __init__(self, device: LocalDevice, home: Path) -> None:
        self.device, self.home = device, home
        self.scripts = home / "scripts"
        self.scripts.mkdir(exist_ok=True)
        self.outbox = Outbox()
        self.outbox.open(8 << 20)
        self.runner = BatchRunner(device.client, self.outbox, FinishedRecord(), client_id="dev",
                                  max_concurrent_sessions=4)
        self.waiting: dict[str, asyncio.Future[Result]] = {}
        self.pump = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        while True:
            while (frame := self.outbox.pop()) is not None:
                msg = decode_client_message(frame[1], 1 << 30)
                if msg.type is ClientMessageType.COMMAND_RESULTS and msg.prev_response_id in self.waiting:
                    self.waiting.pop(msg.prev_response_id).set_result(msg.action_results[0])
            self.outbox.ready.clear()
            await self.outbox.ready.wait()

    def start(self, session: str, command: Command) -> tuple[str, asyncio.Future[Result]]:
        msg = ServerMessage(type=ServerMessageType.COMMAND, actions=[command], session_id=session, timeout=120)
        self.waiting[msg.response_id] = asyncio.get_running_loop().create_future()
        self.runner.submit(msg)
        return msg.response_id, self.waiting[msg.response_id]

    async def call(self, session: str, command: Command) -> Result:
        return await asyncio.wait_for(self.start(session, command)[1], 150)

    async def aclose(self) -> None:
        await self.runner.abort_all(timeout=10)
        self.pump.cancel()
        await asyncio.gather(self.pump, return_exceptions=True)

    def script(self, name: str, code: str) -> str:
        path = self.scripts / f"{name}.py"
        path.write_text(code)
        return str(path)

    async def py(self, session: str, code: str, *argv: str, **params: Any) -> Result:
        script = self.script(f"s{secrets.token_hex(4)}", code)
        return await self.call(session, Command(tool_name="shell.run", parameters={
            "cmd": SYSTEM_PYTHON, "argv": [script, *argv], "cwd": str(self.home), **params}))

    async def true(self, session: str) -> Result:
        return await self.call(session, Command(tool_name="shell.run", parameters={
            "cmd": "true", "argv": [], "cwd": str(self.home)}))

    def restore(self, session: str) -> list[dict[str, Any]]:
        return UndoJournal(self.device.state_dir).restore(session, roots=self.device.policy.write_roots)

    def journal(self, session: str) -> list[dict[str, Any]]:
        return UndoJournal(self.device.state_dir).entries(session)


@pytest.fixture
async def box_factory(home: Path, scratch: Path) -> AsyncIterator[Callable[..., Any]]:
    boxes: list[Box] = []

    async def make(**policy: Any) -> Box:
        # the scratch directory is a write root of its own: the machine's, captured (each session's commands
        # get a private /tmp, which is not captured: `tether.sandbox.private_tmp`)
        policy.setdefault("write_roots", ["~", tempfile.gettempdir(), str(scratch)])
        state = home / ".local/state/tether"
        state.mkdir(parents=True, exist_ok=True)
        device = build_device(policy=policy_from_mapping(policy), state_dir=state, sandbox=True)
        assert device.context.sandbox is not None, "no sandbox was made here (see the log for why)"
        boxes.append(Box(device, home))
        return boxes[-1]

    yield make
    for box in boxes:
        await box.aclose()
        await box.device.aclose()


@pytest.fixture
async def box(box_factory: Callable[..., Any]) -> Box:
    return await box_factory()


def _text(result: Result) -> str:
    return (result.error or "") + "\n" + json.dumps(result.result)[:3000]


def _gate(monkeypatch: pytest.MonkeyPatch, name: str, finished: threading.Event | None = None
          ) -> tuple[threading.Event, threading.Event]:
    """Wrap the real `shell_capture.<name>` so its first call says it started and then waits until the
    test lets it go. Run on the event loop, it would block the loop and the other session could never
    answer: the wait fails after GATE_S instead of hanging."""
    real = getattr(shell_capture, name)
    started, release = threading.Event(), threading.Event()
    first = [True]

    def gated(*args: Any, **kwargs: Any) -> Any:
        if first[0]:
            first[0] = False
            started.set()
            if not release.wait(GATE_S):
                raise AssertionError(f"{name} waited {GATE_S:g}s for another session: the event loop was blocked")
        try:
            return real(*args, **kwargs)
        finally:
            if finished is not None:
                finished.set()

    monkeypatch.setattr(shell_capture, name, gated)
    return started, release


async def _wait(event: threading.Event, what: str) -> None:
    assert await asyncio.to_thread(event.wait, GATE_S), f"{what} never happened"


# ------------------------------------------------------------------ many files: other sessions keep answering


async def test_a_command_making_many_files_does_not_stall_another_session(
        box: Box, scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scanning, scan_go = _gate(monkeypatch, "scan")
    applying, apply_go = _gate(monkeypatch, "apply")
    target = scratch / "many"
    big = asyncio.ensure_future(box.py("big", MAKE_FILES, str(target), str(MANY)))
    try:
        answered = []
        for started, go, phase in ((scanning, scan_go, "capturing"), (applying, apply_go, "applying")):
            await _wait(started, f"the big command {phase}")
            for _ in range(3):  # the other session is served while the big one is mid-capture / mid-apply
                other = await box.true("other")
                assert other.ok, _text(other)
                answered.append(phase)
            assert not big.done(), f"the big command finished before the other session was served ({phase})"
            go.set()
        result = await asyncio.wait_for(big, 120)
    finally:
        scan_go.set()
        apply_go.set()
    assert result.ok, _text(result)
    assert answered == ["capturing"] * 3 + ["applying"] * 3
    assert len(os.listdir(target)) == MANY
    listed = result.result["changes"]
    assert len(listed) == shell_capture.MAX_LISTED + 1 and listed[-1] == {
        "omitted": MANY + 1 - shell_capture.MAX_LISTED, "total": MANY + 1}, listed[-1]
    assert len(box.journal("big")) == MANY + 1  # the directory and every file, all undoable


async def test_a_caller_that_goes_away_mid_apply_never_leaves_half_an_apply(
        box: Box, scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch is cancelled while its apply runs on a worker: the apply still ends whole (every file,
    every journal entry), and only then is its layer released."""
    finished = threading.Event()
    applying, go = _gate(monkeypatch, "apply", finished)
    target = scratch / "some"
    script = box.script("make", MAKE_FILES)
    response_id, result = box.start("gone", Command(tool_name="shell.run", parameters={
        "cmd": SYSTEM_PYTHON, "argv": [script, str(target), "50"], "cwd": str(box.home)}))
    try:
        await _wait(applying, "the apply")
        assert box.runner.cancel(response_id)
        cancelled = await asyncio.wait_for(result, 60)
        assert cancelled.status is ResultStatus.FAILURE and "cancel" in (cancelled.error or ""), _text(cancelled)
    finally:
        go.set()
    await _wait(finished, "the apply's end")
    assert len(os.listdir(target)) == 50
    assert len(box.journal("gone")) == 51
    again = await box.py("gone", MAKE_FILES, str(scratch / "after"), "3")  # the sandbox carries on
    assert again.ok and len(os.listdir(scratch / "after")) == 3, _text(again)


# ------------------------------------------------------------------ sparse stays sparse


async def test_a_one_byte_change_to_a_2gib_sparse_file_stays_sparse_everywhere(box: Box, scratch: Path) -> None:
    big = scratch / "sparse.img"
    size = 2 << 30
    with open(big, "wb") as f:
        f.write(b"head")
        f.truncate(size)
    assert os.stat(big).st_blocks * 512 < SMALL, "this filesystem does not make sparse files"

    def assert_sparse(path: Path, length: int, what: str) -> None:
        st = os.stat(path)
        assert st.st_size == length and st.st_blocks * 512 < SMALL, f"{what} dense: {st.st_blocks} blocks"

    # an append: applied sparse; journaled as the old size alone (no copy at all); undone sparse
    # a bound, not a delay: a loaded machine (parallel workers, other I/O) took over the default 60 s
    appended = await box.py("sparse", APPEND, str(big), timeoutMs=140_000)
    assert appended.ok, _text(appended)
    assert appended.result["changes"] == [{"path": str(big), "kind": "modified", "bytes": size + 1,
                                           "diff_skipped": "over 1 MiB"}]  # never read whole for a diff
    assert_sparse(big, size + 1, "applied")
    with open(big, "rb") as f:
        assert f.read(4) == b"head"
        f.seek(size)
        assert f.read() == b"Z"
    [entry] = box.journal("sparse")
    assert entry["kind"] == "grown" and entry["size"] == size, entry
    [row] = box.restore("sparse")
    assert row["ok"] and row["outcome"] == "restored", row
    assert_sparse(big, size, "undone")

    # a byte written in the middle: the journal keeps a copy, and the copy is sparse too
    poked = await box.py("poke", POKE, str(big), str(1 << 30), timeoutMs=140_000)
    assert poked.ok, _text(poked)
    assert_sparse(big, size, "applied")
    [entry] = box.journal("poke")
    assert_sparse(box.device.state_dir / "journal" / "poke" / "blobs" / entry["blob"], size, "journal copy")
    [row] = box.restore("poke")
    assert row["ok"] and row["outcome"] == "restored", row
    assert_sparse(big, size, "undone")
    with open(big, "rb") as f:
        assert f.read(4) == b"head"
        f.seek(1 << 30)
        assert f.read(1) == b"\0"


async def test_an_append_to_a_big_dense_file_journals_only_its_old_size(box: Box, scratch: Path) -> None:
    """No copy of the old 8 MiB: the journal keeps the old size and a checksum of the added bytes; undo
    cuts the file back, and refuses (leaving it as is) once someone changed the added part."""
    log = scratch / "app.log"
    original = os.urandom(8 << 20)
    log.write_bytes(original)
    result = await box.py("append", APPEND, str(log))
    assert result.ok, _text(result)
    assert log.read_bytes() == original + b"Z"
    [entry] = box.journal("append")
    assert entry["kind"] == "grown" and entry["size"] == len(original) and "blob" not in entry, entry
    assert not (box.device.state_dir / "journal" / "append" / "blobs").exists()
    [row] = box.restore("append")
    assert row["ok"] and row["outcome"] == "restored", row
    assert log.read_bytes() == original

    again = await box.py("append2", APPEND, str(log))
    assert again.ok, _text(again)
    with open(log, "r+b") as f:  # someone rewrites the appended byte after the apply
        f.seek(len(original))
        f.write(b"Q")
    [refused] = box.restore("append2")
    assert not refused["ok"] and refused["outcome"].startswith("conflict"), refused
    assert log.read_bytes() == original + b"Q"


# ------------------------------------------------------------------ names that are not UTF-8


async def test_a_name_that_is_not_utf8_gives_a_clear_result_at_once_and_undoes(box: Box, scratch: Path) -> None:
    raw = os.fsencode(scratch)
    old = raw + b"/old-\xe9.txt"
    with open(old, "wb") as f:
        f.write(b"the original")

    result = await asyncio.wait_for(box.py("names", NON_UTF8, str(scratch)), 60)
    assert result.ok, _text(result)
    changes = {c["path"]: c for c in result.result["changes"]}
    new_shown, old_shown = f"{scratch}/new-\\xff\\xfe.txt", f"{scratch}/old-\\xe9.txt"
    assert changes[new_shown]["kind"] == "created" and changes[new_shown]["escaped"] is True, changes
    assert changes[old_shown]["kind"] == "modified", changes
    # what the device sends the server encodes (it used to fail there and leave the caller to time out)
    msg = ServerMessage(type=ServerMessageType.COMMAND, actions=[Command(tool_name="shell.run")], session_id="names")
    frame = json.loads(results_frame(msg, result, last=True, client_id=None, max_bytes=8 << 20))
    assert frame["action_results"][0]["status"] == "success", frame
    assert new_shown in [c["path"] for c in frame["action_results"][0]["result"]["changes"]]
    with open(raw + b"/new-\xff\xfe.txt", "rb") as f:
        assert f.read() == b"made by the command"

    report = box.restore("names")
    assert all(row["ok"] for row in report), report
    json.dumps(report).encode("utf-8")  # the report encodes too
    assert not os.path.lexists(raw + b"/new-\xff\xfe.txt")
    with open(old, "rb") as f:
        assert f.read() == b"the original"


def test_any_result_json_cannot_carry_fails_at_once_with_a_clear_error() -> None:
    """Whatever tool puts undecodable text in a result, the caller hears at once why it failed."""
    msg = ServerMessage(type=ServerMessageType.COMMAND, actions=[Command(tool_name="x")], session_id="s")
    bad = Result(status=ResultStatus.SUCCESS, result={"path": "/tmp/a-\udcff"}, call_id="c1")
    frame = json.loads(results_frame(msg, bad, last=True, client_id=None, max_bytes=1 << 20))
    [sent] = frame["action_results"]
    assert sent["status"] == "failure" and "could not be encoded" in sent["error"], sent
    assert sent["call_id"] == "c1" and sent["result"]["unencodable"] is True


# ------------------------------------------------------------------ another session's change is never lost


async def test_a_delete_never_takes_an_entry_another_session_created_meanwhile(
        box: Box, scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Order 1: session A runs `rm -rf dir`; before A's apply, session B creates dir/new (applied). A's
    apply is a conflict naming dir/new, and nothing of A is applied: dir and both files stay."""
    tree = scratch / "dir"
    tree.mkdir()
    (tree / "old.txt").write_text("old")
    scanning, go = _gate(monkeypatch, "scan")
    deleter = asyncio.ensure_future(box.py("A", RMTREE, str(tree)))
    try:
        await _wait(scanning, "session A's capture")
        creator = await box.py("B", CREATE, str(tree / "new.txt"), "B's work")
        assert creator.ok, _text(creator)
        go.set()
        result = await asyncio.wait_for(deleter, 60)
    finally:
        go.set()
    assert result.status is ResultStatus.FAILURE, _text(result)
    error = result.error or ""
    assert "nothing was applied" in error and str(tree / "new.txt") in error, _text(result)
    assert str(tree / "new.txt") in result.result["conflicts"] and result.result["applied"] is False
    assert (tree / "new.txt").read_text() == "B's work" and (tree / "old.txt").read_text() == "old"
    assert box.journal("A") == []


async def test_a_create_never_brings_back_a_directory_another_session_deleted_meanwhile(
        box: Box, scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Order 2: session A creates dir/new inside an existing dir; before A's apply, session B deletes dir
    (applied). A's apply is a conflict: dir stays deleted, nothing of A is applied."""
    tree = scratch / "dir"
    tree.mkdir()
    (tree / "old.txt").write_text("old")
    scanning, go = _gate(monkeypatch, "scan")
    creator = asyncio.ensure_future(box.py("A", CREATE, str(tree / "new.txt"), "A's work"))
    try:
        await _wait(scanning, "session A's capture")
        deleter = await box.py("B", RMTREE, str(tree))
        assert deleter.ok, _text(deleter)
        go.set()
        result = await asyncio.wait_for(creator, 60)
    finally:
        go.set()
    assert result.status is ResultStatus.FAILURE, _text(result)
    assert "nothing was applied" in (result.error or ""), _text(result)
    assert str(tree) in result.result["conflicts"], _text(result)
    assert not tree.exists()
    assert box.journal("A") == []


async def test_an_overwrite_never_replaces_what_another_session_wrote_meanwhile(
        box: Box, scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sessions write the same file; the one applied second is the conflict, whichever it is."""
    shared = scratch / "shared.txt"
    shared.write_text("v0")
    scanning, go = _gate(monkeypatch, "scan")
    first = asyncio.ensure_future(box.py("A", CREATE, str(shared), "from A"))
    try:
        await _wait(scanning, "session A's capture")
        second = await box.py("B", CREATE, str(shared), "from B")
        assert second.ok, _text(second)
        go.set()
        result = await asyncio.wait_for(first, 60)
    finally:
        go.set()
    assert result.status is ResultStatus.FAILURE and str(shared) in result.result["conflicts"], _text(result)
    assert shared.read_text() == "from B"
    # and a command that starts after B's change applies as usual
    again = await box.py("A", CREATE, str(shared), "from A, again")
    assert again.ok, _text(again)
    assert shared.read_text() == "from A, again"


# ------------------------------------------------------------------ limits


async def test_a_command_over_the_layer_limits_fails_naming_the_limit_and_applies_nothing(
        box_factory: Callable[..., Any], scratch: Path) -> None:
    box = await box_factory(limits={"layer_files": 50, "layer_bytes": 1 << 20})
    many = await box.py("lim", MAKE_FILES, str(scratch / "many"), "60")
    assert many.status is ResultStatus.FAILURE, _text(many)
    assert "limits.layer_files" in (many.error or "") and many.result["limit"] == "limits.layer_files", _text(many)
    assert not (scratch / "many").exists()

    fat = await box.py("lim", WRITE_BYTES, str(scratch / "fat.bin"), str(2 << 20))
    assert fat.status is ResultStatus.FAILURE, _text(fat)
    assert "limits.layer_bytes" in (fat.error or "") and fat.result["limit"] == "limits.layer_bytes", _text(fat)
    assert not (scratch / "fat.bin").exists()

    fine = await box.py("lim", MAKE_FILES, str(scratch / "few"), "10")
    assert fine.ok, _text(fine)
    assert len(os.listdir(scratch / "few")) == 10
    assert box.journal("lim") and all(e["path"].startswith(str(scratch / "few")) for e in box.journal("lim"))
