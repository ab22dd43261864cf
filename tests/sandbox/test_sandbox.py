"""The sandbox mechanism itself (tether.sandbox), with real bubblewrap: what a confined process sees,
what its overlay layer records, and how a layer is applied. The attacks are in tests/attacks/."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tether.sandbox import SandboxSpec, detect
from tether.sandbox.egress.owner import children
from tether.sandbox.layers.fs import EscapeError
from tether.sandbox.layers.layer import ApplyConflict, Change, apply, discard
from tether.sandbox.layers.scan import scan
from tether.sandbox.runner import SWEEP_BATCH, Sandbox

PY = os.path.realpath(sys.executable)


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    root, live, layers, secret = (tmp_path / n for n in ("root", "live", "layers", "secret"))
    for d in (root, live, layers):
        d.mkdir()
    secret.write_text("s3cret-token")
    return {"root": root, "live": live, "layers": layers, "secret": secret, "tmp": tmp_path}


@pytest.fixture
async def sandbox(tree: dict[str, Path]) -> AsyncIterator[Sandbox]:
    info = detect()
    assert info.available, f"the sandbox tests need bubblewrap: {info.detail}"
    spec = SandboxSpec.build(write_roots=[str(tree["root"])], live_write_roots=[str(tree["live"])],
                             hidden=[str(tree["secret"])], layers_dir=str(tree["layers"]))
    box = Sandbox(info, spec)
    try:
        yield box
    finally:
        await box.aclose()


async def run(box: Sandbox, code: str, *, layer: Path | None = None, cwd: str = "/") -> tuple[int, str, str]:
    proc = await box.spawn([PY, "-c", code], executable=PY, cwd=cwd, env={"PATH": "/usr/bin:/bin"},
                           stdin=False, layer=layer)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
    return await proc.wait(), out.decode(), err.decode()


async def test_a_confined_process_sees_no_capabilities_no_device_and_no_secret(sandbox: Sandbox,
                                                                             tree: dict[str, Path]) -> None:
    code, out, err = await run(sandbox, f"""
import os
print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])
print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
print(repr(open({str(tree['secret'])!r}).read()))
print({os.getpid()} in [int(p) for p in os.listdir('/proc') if p.isdigit()])
""")
    assert code == 0, err
    caps, pids, secret, sees_us = out.splitlines()
    assert int(caps, 16) == 0
    assert pids == "[1]"  # its own pid namespace: nothing else, not the device
    assert secret == "''" and sees_us == "False"


async def test_writes_outside_the_roots_fail_and_inside_land_in_the_layer(sandbox: Sandbox,
                                                                        tree: dict[str, Path]) -> None:
    root = tree["root"]
    (root / "keep.txt").write_text("old")
    (root / "gone.txt").write_text("bye")
    (root / "same.txt").write_text("same")
    layer = sandbox.new_layer()
    code, _, err = await run(sandbox, f"""
import os
open({str(root / 'keep.txt')!r}, 'w').write('new')
open({str(root / 'made.txt')!r}, 'w').write('made')
os.unlink({str(root / 'gone.txt')!r})
open({str(root / 'same.txt')!r}, 'w').write('same')  # copied up, same bytes: no change
os.makedirs({str(root / 'd' / 'e')!r})
try:
    open({str(tree['tmp'] / 'outside.txt')!r}, 'w')
except OSError as exc:
    print(exc.strerror)
""", layer=layer)
    assert code == 0, err
    assert not (tree["tmp"] / "outside.txt").exists()
    assert (root / "keep.txt").read_text() == "old" and not (root / "made.txt").exists()  # nothing applied yet
    changes = {c.path: c for c in scan(layer, sandbox.spec.write_roots)}
    assert {p: c.kind for p, c in changes.items()} == {
        str(root / "keep.txt"): "modified", str(root / "made.txt"): "created", str(root / "gone.txt"): "deleted",
        str(root / "d"): "created", str(root / "d" / "e"): "created"}
    done: list[tuple[str, str, str | None, str | None]] = []  # (action, path, dest, the layer's new content)
    apply(list(changes.values()), done.extend)
    discard(layer)
    assert (root / "keep.txt").read_text() == "new" and (root / "made.txt").read_text() == "made"
    assert not (root / "gone.txt").exists() and (root / "d" / "e").is_dir()
    recorded = [d[:3] for d in done]
    assert ("delete", str(root / "gone.txt"), None) in recorded and ("write", str(root / "keep.txt"), None) in recorded
    assert not layer.exists()


async def test_a_rename_is_one_change_and_a_replaced_directory_is_seen_whole(sandbox: Sandbox,
                                                                           tree: dict[str, Path]) -> None:
    root = tree["root"]
    (root / "a.txt").write_text("payload")
    (root / "dir").mkdir()
    (root / "dir" / "old1").write_text("1")
    (root / "dir" / "old2").write_text("2")
    layer = sandbox.new_layer()
    code, _, err = await run(sandbox, f"""
import os, shutil
os.rename({str(root / 'a.txt')!r}, {str(root / 'b.txt')!r})
shutil.rmtree({str(root / 'dir')!r}); os.mkdir({str(root / 'dir')!r})
open({str(root / 'dir' / 'new')!r}, 'w').write('n')
""", layer=layer)
    assert code == 0, err
    changes = scan(layer, sandbox.spec.write_roots)
    kinds = sorted((c.kind, os.path.relpath(c.path, root)) for c in changes)
    assert ("renamed", "b.txt") in kinds and ("deleted", "a.txt") not in kinds
    assert {("deleted", "dir/old1"), ("deleted", "dir/old2"), ("created", "dir/new")} <= set(kinds)
    apply(changes, lambda *_: None)
    discard(layer)
    assert (root / "b.txt").read_text() == "payload" and not (root / "a.txt").exists()
    assert sorted(p.name for p in (root / "dir").iterdir()) == ["new"]


async def test_apply_refuses_a_tree_that_changed_since_and_a_link_planted_in_the_path(sandbox: Sandbox,
                                                                                     tree: dict[str, Path]) -> None:
    root = tree["root"]
    (root / "f.txt").write_text("v1")
    (root / "sub").mkdir()
    layer = sandbox.new_layer()
    code, _, err = await run(sandbox, f"""
open({str(root / 'f.txt')!r}, 'w').write('sandbox')
open({str(root / 'sub' / 'new.txt')!r}, 'w').write('x')
""", layer=layer)
    assert code == 0, err
    changes = scan(layer, sandbox.spec.write_roots)
    (root / "f.txt").write_text("someone else, meanwhile")
    with pytest.raises(ApplyConflict):
        apply(changes, lambda *_: None)
    assert (root / "f.txt").read_text() == "someone else, meanwhile" and not (root / "sub" / "new.txt").exists()
    only_new = [c for c in changes if c.path.endswith("new.txt")]
    outside = tree["tmp"] / "elsewhere"
    outside.mkdir()
    (root / "sub").rmdir()
    (root / "sub").symlink_to(outside)  # planted after the scan: the write must not follow it
    with pytest.raises(EscapeError):
        apply(only_new, lambda *_: None)
    assert list(outside.iterdir()) == []
    discard(layer)


async def test_a_pooled_layer_takes_a_fresh_overlay_every_time_and_its_old_work_dirs_are_swept(
        sandbox: Sandbox, tree: dict[str, Path]) -> None:
    """Each overlay is volatile (nothing syncs the whole filesystem when it goes) and mounted over the same
    pooled layer again and again: the old work directory (with the marker that would refuse the next mount)
    is set aside first, so every command gets its overlay, and the set-aside ones are removed in batches."""
    true, sh = shutil.which("true"), shutil.which("sh")
    assert true and sh, "apt-get install -y coreutils dash"
    used: set[Path] = set()
    for _ in range(2 * SWEEP_BATCH + 1):
        layer = sandbox.new_layer()
        used.add(layer)
        proc = await sandbox.spawn(["true"], executable=true, cwd="/", env={}, stdin=False, layer=layer)
        assert proc.stdout is not None and proc.stderr is not None
        await asyncio.gather(proc.stdout.read(), proc.stderr.read())
        assert await proc.wait() == 0
        assert proc.notes == []  # a refused overlay would leave the root read-only, and say so here
        sandbox.release(layer)
    assert len(used) == 1, "an empty layer goes back to the pool"
    layer = sandbox.new_layer()
    made = tree["root"] / "made.txt"
    proc = await sandbox.spawn(["sh", "-c", f"echo hi > {made}"], executable=sh, cwd="/", env={}, stdin=False,
                               layer=layer)
    assert proc.stdout is not None and proc.stderr is not None
    _, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
    assert await proc.wait() == 0, err
    assert [(c.path, c.kind) for c in scan(layer, sandbox.spec.write_roots)] == [(str(made), "created")]
    assert not made.exists()
    await asyncio.gather(*sandbox._removing)  # the sweeps started so far
    left = [p.name for p in (layer / "0" / "w").iterdir() if p.name.startswith("gone-")]
    assert len(left) <= SWEEP_BATCH, f"set-aside work directories were not removed: {left}"
    sandbox.release(layer)


async def test_a_namespace_made_ahead_shows_the_machine_as_it_is_when_its_command_runs(tree: dict[str, Path]) -> None:
    """Between commands the warden mounts the next command's namespace on the pooled layer (primed): what
    changes on the machine meanwhile is what that command sees, a secret created meanwhile at a hidden
    path (inside a captured root, and outside) is hidden all the same, and its writes land in its layer."""
    root, aws, late = tree["root"], tree["root"] / ".aws", tree["tmp"] / "later-secret"
    spec = SandboxSpec.build(write_roots=[str(root)], hidden=[str(aws), str(late)], layers_dir=str(tree["layers"]))
    box = Sandbox(detect(), spec)
    try:
        first = box.new_layer()
        assert (await run(box, "pass", layer=first))[0] == 0
        box.release(first)  # empty: the warden primes the next command's namespace on it
        assert box._warden_host_pid is not None
        waiting = await asyncio.to_thread(_one_child, box._warden_host_pid)
        (root / "new.txt").write_text("fresh")
        aws.mkdir()
        (aws / "credentials").write_text("aws-key")
        late.write_text("late-token")
        layer = box.new_layer()
        assert layer == first
        code, out, err = await run(box, f"""
import os
print(open({str(root / 'new.txt')!r}).read())
print(os.path.exists({str(aws / 'credentials')!r}), repr(open({str(late)!r}).read()))
print(os.getpid())
open({str(root / 'out.txt')!r}, 'w').write('mine')
""", layer=layer)
        assert code == 0, err
        assert out.split() == ["fresh", "False", "''", "1"]
        assert waiting not in children(box._warden_host_pid)  # it ran the command and is gone
        assert [c.path for c in scan(layer, spec.write_roots)] == [str(root / "out.txt")]
        assert not (root / "out.txt").exists()
        discard(layer)
    finally:
        await box.aclose()


def _one_child(warden: int) -> int:
    """The process the warden keeps for the next command, once it waits for it (blocked reading its control
    socket: its mounts are made)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for pid in children(warden):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/wchan") as f:
                if "wait_for_more_packets" in f.read():
                    return pid
        time.sleep(0.002)  # no event to wait on: the kernel's wait channel is polled (bounded)
    raise AssertionError("the warden primed no namespace")


async def test_live_roots_are_written_at_once_and_not_captured(sandbox: Sandbox, tree: dict[str, Path]) -> None:
    layer = sandbox.new_layer()
    code, _, err = await run(sandbox, f"open({str(tree['live'] / 'now.txt')!r}, 'w').write('live')", layer=layer)
    assert code == 0, err
    assert (tree["live"] / "now.txt").read_text() == "live"
    assert scan(layer, sandbox.spec.write_roots) == []
    discard(layer)


async def test_a_kill_takes_the_whole_pid_namespace_and_the_warden_comes_back(sandbox: Sandbox,
                                                                            tree: dict[str, Path]) -> None:
    proc = await sandbox.spawn([PY, "-c", "import subprocess, sys; subprocess.Popen(['sleep', '999']); "
                                "print('up', flush=True); sys.stdin.read()"], executable=PY, cwd="/",
                               env={"PATH": "/usr/bin:/bin"}, stdin=True, layer=None)
    assert proc.stdout is not None
    assert (await proc.stdout.readline()).strip() == b"up"
    proc.kill()
    assert await asyncio.wait_for(proc.wait(), 30) == -9
    assert await proc.stdout.read() == b""  # the sleep held stdout too: it is gone with the namespace
    warden = sandbox._proc
    assert warden is not None
    warden.kill()
    await warden.wait()
    code, out, _ = await run(sandbox, "print('again')")
    assert (code, out) == (0, "again\n") and sandbox._proc is not warden


async def test_network_off_leaves_only_loopback_of_its_own(tree: dict[str, Path]) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    spec = SandboxSpec.build(write_roots=[], network=False, layers_dir=str(tree["layers"]))
    box = Sandbox(detect(), spec)
    try:
        code, out, err = await run(box, f"""
import socket
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=5); print('connected')
except OSError as exc:
    print('refused', exc.errno)
""")
    finally:
        await box.aclose()
        listener.close()
    assert code == 0, err
    assert out.startswith("refused")


def test_changes_say_what_happened() -> None:
    change = Change("/h/b.txt", "renamed", 3, "file", "/h", moved_from="/h/a.txt")
    assert change.public() == {"path": "/h/b.txt", "kind": "renamed", "bytes": 3, "from": "/h/a.txt"}


async def test_a_held_layer_is_taken_once_even_from_another_process(sandbox: Sandbox, tree: dict[str, Path]) -> None:
    from tether.sandbox.layers.held import Held, HeldLayers

    root = tree["root"]
    layer = sandbox.new_layer()
    code, _, err = await run(sandbox, f"open({str(root / 'n.txt')!r}, 'w').write('held')", layer=layer)
    assert code == 0, err
    changes = scan(layer, sandbox.spec.write_roots)
    HeldLayers(Path(sandbox.spec.layers_dir)).put("k1", Held(layer, changes, {"stdout": "once"}))
    elsewhere = HeldLayers(Path(sandbox.spec.layers_dir))  # as a later `tether exec --approve` would
    assert elsewhere.take("other-command") is None
    held = elsewhere.take("k1")
    assert held is not None and held.payload == {"stdout": "once"} and held.layer == layer
    assert [c.public() for c in held.changes] == [c.public() for c in changes]
    assert HeldLayers(Path(sandbox.spec.layers_dir)).take("k1") is None  # at most once
    apply(held.changes, lambda *_: None)
    assert (root / "n.txt").read_text() == "held"
    discard(layer)


async def test_without_a_sandbox_a_serving_device_refuses_and_a_local_one_warns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from tether.device.local import build_device
    from tether.protocol.models import Command
    from tether.sandbox import SandboxInfo

    monkeypatch.setenv("HOME", str(tmp_path))
    nothing = SandboxInfo("none", "bwrap is not installed: install bubblewrap")
    command = Command(tool_name="shell.run", parameters={"cmd": "true", "argv": [], "cwd": str(tmp_path)})
    serving = build_device(state_dir=tmp_path / "s1", serving=True, sandbox=nothing)
    try:
        [refused] = await serving.dispatcher(session_id="a").execute_commands([command])
    finally:
        await serving.aclose()
    assert not refused.ok and "sandbox.required" in (refused.error or "")
    assert "bubblewrap" in (refused.error or "")  # says what to do
    assert "no sandbox: bwrap is not installed" in caplog.text  # said at start
    local = build_device(state_dir=tmp_path / "s2", serving=False, sandbox=nothing)
    try:
        [ran] = await local.dispatcher(session_id="b").execute_commands([command])
    finally:
        await local.aclose()
    assert ran.ok, ran.error
    assert "sandbox" not in ran.result and "changes" not in ran.result  # unconfined: nothing captured


async def test_the_policy_can_turn_the_sandbox_off_and_a_serving_device_then_refuses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.device.local import build_device
    from tether.protocol.models import Command
    from tether.tools.policy.model import policy_from_mapping

    monkeypatch.setenv("HOME", str(tmp_path))
    command = Command(tool_name="shell.run", parameters={"cmd": "true", "argv": [], "cwd": str(tmp_path)})
    for settings, ok in (({"sandbox": False}, False), ({"sandbox": False, "require_sandbox": False}, True)):
        device = build_device(policy=policy_from_mapping(settings), state_dir=tmp_path / str(ok), serving=True)
        try:
            [result] = await device.dispatcher(session_id="c").execute_commands([command])
        finally:
            await device.aclose()
        assert result.ok is ok, result.error
        assert device.context.sandbox is None


async def test_a_root_with_a_mount_inside_stays_read_only_and_says_why(tree: dict[str, Path]) -> None:
    import subprocess

    if os.getuid() != 0:
        pytest.fail("this test mounts a tmpfs inside a write root: run it as root (CI does)")
    inner = tree["root"] / "usb"
    inner.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(inner)], check=True)
    box = Sandbox(detect(), SandboxSpec.build(write_roots=[str(tree["root"])], layers_dir=str(tree["layers"])))
    try:
        layer = box.new_layer()
        proc = await box.spawn([PY, "-c", f"open({str(tree['root'] / 'x')!r}, 'w')"], executable=PY, cwd="/",
                               env={}, stdin=False, layer=layer)
        assert proc.stdout is not None and proc.stderr is not None
        _, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
        assert await proc.wait() != 0 and b"Read-only file system" in err
        assert len(proc.notes) == 1 and "read-only for this command" in proc.notes[0]
        assert str(tree["root"]) in proc.notes[0] and not (tree["root"] / "x").exists()
    finally:
        await box.aclose()
        subprocess.run(["umount", "-l", str(inner)], check=False)


async def test_another_apply_of_this_device_is_a_conflict_even_where_ctime_cannot_tell(sandbox: Sandbox,
                                                                                       tree: dict[str, Path]) -> None:
    """The coarse clock can stamp a change made just after the command started with a ctime before it:
    what this device's own applies made meanwhile (`Sandbox.applied_since`) is compared path by path."""
    import time

    from tether.sandbox.layers.layer import conflicts

    root = tree["root"]
    (root / "dir").mkdir()
    (root / "dir" / "old.txt").write_text("old")
    layer = sandbox.new_layer()
    code, _, err = await run(sandbox, f"import shutil; shutil.rmtree({str(root / 'dir')!r})", layer=layer)
    assert code == 0, err
    (root / "dir" / "new.txt").write_text("another session's")  # applied by another session meanwhile
    sandbox.note_applied([str(root / "dir" / "new.txt")], [])
    late = time.time_ns() + 10**12  # as if every stamp lagged: ctime alone sees nothing newer
    changes = scan(layer, sandbox.spec.write_roots, since_ns=late)
    assert conflicts(changes) == []
    others = sandbox.applied_since(layer)
    assert others is not None and conflicts(changes, others) == [str(root / "dir" / "new.txt")]
    with pytest.raises(ApplyConflict):
        apply(changes, lambda *_: None, others)
    assert (root / "dir" / "new.txt").exists() and (root / "dir" / "old.txt").exists()
    # an apply of this device made before the command started is not its business
    assert sandbox.applied_since(sandbox.new_layer()) == []
    discard(layer)


async def test_what_appears_in_a_tree_between_the_check_and_its_removal_is_kept(sandbox: Sandbox,
                                                                                 tree: dict[str, Path]) -> None:
    """The last window: another session writes into a directory this apply deletes after the conflict
    check passed (here: while the batch is journaled). Its file is kept and the apply stops, saying so."""
    import time

    from tether.sandbox.layers.layer import LateConflict

    root = tree["root"]
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "dir" / "sub" / "old.txt").write_text("old")
    (root / "dir" / "top.txt").write_text("top")
    layer = sandbox.new_layer()
    started = time.time_ns()
    code, _, err = await run(sandbox, f"import shutil; shutil.rmtree({str(root / 'dir')!r})", layer=layer)
    assert code == 0, err
    changes = scan(layer, sandbox.spec.write_roots, since_ns=started)

    def meanwhile(_batch: object) -> None:
        (root / "dir" / "sub" / "theirs.txt").write_text("another session's")

    with pytest.raises(LateConflict) as caught:
        apply(changes, meanwhile)
    # the directory it landed in changed after the command started: kept whole, with what is in it
    assert caught.value.paths == [str(root / "dir" / "sub")]
    assert (root / "dir" / "sub" / "theirs.txt").read_text() == "another session's"
    assert not (root / "dir" / "top.txt").exists()
    discard(layer)


async def test_whiteouts_planted_over_hidden_paths_are_no_change_to_the_capture(tree: dict[str, Path]) -> None:
    """The capture's scan (tools.shell.capture, on the worker pool) is given the hidden paths: the whiteout
    the warden plants over one below a captured root is never a deletion nor counted against the layer's
    limits, and a layer holding only such whiteouts is empty (reused, nothing to settle)."""
    from tether.sandbox.layers.layer import LayerLimits
    from tether.sandbox.runner import layer_empty
    from tether.tools.shell.capture import _scan

    keys = tree["root"] / ".ssh"
    keys.mkdir()
    (keys / "id_rsa").write_text("PRIVATE KEY\n")
    info = detect()
    assert info.available, info.detail
    box = Sandbox(info, SandboxSpec.build(write_roots=[str(tree["root"])], hidden=[str(keys)],
                                          layers_dir=str(tree["layers"])))
    try:
        roots, hidden = box.spec.write_roots, box.spec.hidden
        layer = box.new_layer()
        code, out, err = await run(box, f"import os; print(os.path.exists({str(keys)!r}))", layer=layer)
        assert (code, out.strip()) == (0, "False"), err  # absent from the command's view: a whiteout
        assert os.listdir(layer / "0" / "u") == [".ssh"]  # the warden's, in the layer
        assert layer_empty(layer, roots, hidden) and not layer_empty(layer, roots)
        assert _scan(layer, roots, hidden, 0, LayerLimits(files=1)) == []
        code, _, err = await run(box, f"open({str(tree['root'] / 'made.txt')!r}, 'w').write('x')", layer=layer)
        assert code == 0, err
        assert not layer_empty(layer, roots, hidden)
        changes = _scan(layer, roots, hidden, 0, LayerLimits(files=1))  # the whiteout takes none of the 1
        assert [(c.path, c.kind) for c in changes] == [(str(tree["root"] / "made.txt"), "created")]
        discard(layer)
    finally:
        await box.aclose()
    assert (keys / "id_rsa").read_text() == "PRIVATE KEY\n"
