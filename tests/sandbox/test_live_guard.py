"""A live process (a sandboxed stdio MCP server, a launched application) starts whatever else lies in the roots it
writes, and its protected paths stay read-only: a protected file in another user's 0700 directory under a shared
write root (a `tether server`'s `server.db` in its state directory under /tmp) is left out of its mounts — the
sandboxed user cannot reach it, and bubblewrap, started as that user, failed to start on it ("Can't find source
path …: Permission denied") — and one removed between the plan and the start is skipped. Real bubblewrap, as the
unprivileged `run_as` user a root device uses."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether.sandbox.confine.bwrap import live_argv
from tether.sandbox.confine.run_as import resolve_run_as
from tether.sandbox.confine.spec import SandboxSpec


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A directory every user may write, under /tmp itself (pytest's own base is root's, 0700)."""
    if os.geteuid() != 0:
        pytest.fail("this test plays a root device whose sandbox runs as an unprivileged user: run it as root "
                    "(CI does)")
    root = Path(tempfile.mkdtemp(prefix="tether-live-guard-", dir="/tmp"))
    root.chmod(0o777)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(spec: SandboxSpec, script: str, cwd: Path, before: list[Path] = ()) -> subprocess.CompletedProcess[str]:  # type: ignore[assignment]
    argv = live_argv(spec, [], cwd=str(cwd), bwrap=shutil.which("bwrap") or "bwrap")
    # bubblewrap's own arguments as a live process gets them; then `sh` straight away, not tether's confinement
    # shim (its interpreter, in this checkout, may be out of the unprivileged user's reach)
    cut = argv.index("--", argv.index("--") + 1) + 1  # bwrap's own "--" (setpriv's comes before bwrap)
    argv = [*argv[:cut], "sh", "-c", script]
    for path in before:  # gone after the plan was made, before bubblewrap looks
        path.unlink()
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_a_protected_file_out_of_reach_or_gone_does_not_stop_a_live_process(shared_root: Path) -> None:
    run_as = resolve_run_as("nobody")
    assert run_as is not None
    private = shared_root / "tether-demo-x" / "state"  # another server's state directory: root's, 0700
    private.mkdir(parents=True)
    private.chmod(0o700)
    (private / "server.db").write_text("tokens")
    public = shared_root / "project"  # a protected file the sandboxed user can reach
    public.mkdir()
    public.chmod(0o777)
    (public / "server.db").write_text("kept")
    (public / "server.db").chmod(0o666)
    doomed = shared_root / "gone"
    doomed.mkdir()
    doomed.chmod(0o777)
    (doomed / "server.db").write_text("x")
    spec = SandboxSpec.build(write_roots=[], live_write_roots=[str(shared_root)], run_as=run_as,
                             protected_names=["server.db"])
    ran = _run(spec, "echo changed > project/server.db; echo new > made.txt; echo started",
               shared_root, before=[doomed / "server.db"])
    assert "started" in ran.stdout, ran.stderr  # bubblewrap started: nothing it cannot reach was mounted
    assert "Read-only file system" in ran.stderr, ran.stderr
    assert (public / "server.db").read_text() == "kept"  # the reachable protected file stayed read-only
    assert (shared_root / "made.txt").read_text() == "new\n"  # the live root is written directly
    assert (private / "server.db").read_text() == "tokens"
