"""Red team (session 34): what a command leaves behind for another program to run, tried as an agent
holding `execute` (not `approve`) would, through a real device's dispatcher, real bubblewrap, real git.

Each attack writes a place that a later `git status`, an interpreter, a terminal or a desktop session
of the user's runs or loads, by a route the default protected list did not name: a repository git
finds through a `.git` *file* (`git init --separate-git-dir`, a submodule's checkout), a submodule's
own config and hooks under `.git/modules/`, and start-up files of other programs of the same classes
(another version control system, shells, debuggers and interpreters, terminals and prompts, desktop
shells' plug-ins, editors' extensions, window managers). Every one must wait for a person, whichever
tool writes it. One device serves the whole module; HOME is a fresh directory under /var/tmp.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.kits.confined_device import SessionCaller
from tether.device.local import LocalDevice, build_device
from tether.protocol.models import Result, ResultStatus
from tether.tools.policy.model import policy_from_mapping

pytestmark = pytest.mark.asyncio(loop_scope="module")
SESSION = "left-behind"
# the policy's other approval rules are all off: what holds these writes is the protected list alone
POLICY = {"approval": {"delete": False, "move": False, "overwrite_outside_temp": False}}


class Attacker(SessionCaller):
    """An agent's session on the device (`SESSION`)."""

    def __init__(self, device: LocalDevice, home: Path) -> None:
        super().__init__(device, home, SESSION)


def _text(result: Result) -> str:
    return ((result.error or "") + "\n" + json.dumps(result.result))[:1500]


def _held(result: Result, pattern: str) -> None:
    assert result.status is ResultStatus.FAILURE, f"went through without a person: {_text(result)}"
    assert isinstance(result.result, dict) and result.result.get("needs_approval") is True, _text(result)
    assert result.result["rule"] == f"protected-path: {pattern}", _text(result)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def attacker() -> AsyncIterator[Attacker]:
    for program in ("bwrap", "git"):
        if shutil.which(program) is None:
            pytest.fail(f"{program} is not installed; install it with: apt-get install -y "
                        f"{'bubblewrap' if program == 'bwrap' else program}")
    home = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-left-behind-")).resolve()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        patch.setenv("GIT_CONFIG_NOSYSTEM", "1")
        state = home / ".local/state/tether"
        state.mkdir(parents=True)
        device = build_device(policy=policy_from_mapping(POLICY), state_dir=state, sandbox=True)
        try:
            assert device.context.sandbox is not None, "no sandbox was made here (see the log for why)"
            await device.computer_manager.get_or_create(None)
            yield Attacker(device, home)
        finally:
            await device.aclose()
            shutil.rmtree(home, ignore_errors=True)


def _git(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-c", "protocol.file.allow=always", *argv], cwd=cwd, check=True,
                          capture_output=True, text=True, timeout=30)


def _fsmonitor_runs(worktree: Path, marker: Path) -> bool:
    """Whether a user's plain `git status` in `worktree` runs the repository's fsmonitor command (the
    proof that the place the attack writes is one git really obeys)."""
    subprocess.run(["git", "status", "--porcelain"], cwd=worktree, capture_output=True, timeout=30)
    return marker.exists()


# ------------------------------------------------------------------ git finds its repository through a `.git` file


async def test_a_git_file_pointing_at_a_repository_the_agent_made_is_held(attacker: Attacker) -> None:
    home = attacker.home
    marker = home / "fsmonitor-ran-1"
    # one standard git command: `proj/.git` is a file (`gitdir: ...`), the repository lies in `kit`,
    # whose `config` and `hooks/` no `.git/...` pattern names
    made = await attacker.run("git", "init", "-q", "--separate-git-dir", str(home / "kit"), str(home / "proj"))
    assert made.status is ResultStatus.FAILURE and made.result.get("needs_approval") is True, _text(made)
    assert "protected-path: .git" in {c["rule"] for c in made.result["needs_approval_for"]}, _text(made)
    assert not (home / "proj/.git").exists() and not (home / "kit").exists(), _text(made)

    # the same by hand: a repository made where nothing is protected, then the file that makes git use it
    (home / "kit2").mkdir()
    _git("init", "-q", "--bare", str(home / "kit2"), cwd=home)
    _git("config", "--file", str(home / "kit2/config"), "core.bare", "false", cwd=home)
    _git("config", "--file", str(home / "kit2/config"), "core.fsmonitor", f"touch {marker}", cwd=home)
    (home / "proj2").mkdir()
    for tool, route in (("write_file", {"file_path": str(home / "proj2/.git"), "content": "gitdir: ../kit2\n"}),
                        ("shell", None)):
        if route is not None:
            _held(await attacker.call(tool, **route), ".git")
        else:
            _held(await attacker.run("tee", str(home / "proj2/.git"), stdin="gitdir: ../kit2\n"), ".git")
            _held(await attacker.run("ln", "-s", str(home / "kit2"), str(home / "proj2/.git")), ".git")
        assert not os.path.lexists(home / "proj2/.git")
    # a person may: and then git really runs that repository's command, so the file was worth holding
    approved = await attacker.call("write_file", file_path=str(home / "proj2/.git"), content="gitdir: ../kit2\n",
                                   approved_by="alice")
    assert approved.ok, _text(approved)
    assert _fsmonitor_runs(home / "proj2", marker), "git did not use the repository the .git file names"


async def test_a_directory_named_dot_git_is_not_held_by_the_git_file_rule(attacker: Attacker) -> None:
    # only a .git that is not a directory is a pointer; a plain directory with nothing git reads in it is not
    made = await attacker.run("mkdir", "-p", str(attacker.home / "plain/.git/objects"))
    assert made.ok, _text(made)


# ------------------------------------------------------------------ a repository under another name


async def test_an_embedded_bare_repositorys_config_and_hooks_are_held(attacker: Attacker) -> None:
    home = attacker.home
    # one command makes it: evil.git/config and evil.git/hooks match no .git/... pattern
    made = await attacker.run("git", "init", "-q", "--bare", str(home / "evil.git"))
    _held(made, "git directory")
    assert not (home / "evil.git").exists()
    rules = {c["path"].removeprefix(str(home)): c["rule"] for c in made.result["needs_approval_for"]}
    assert rules.get("/evil.git/config") == "protected-path: git directory", rules
    assert rules.get("/evil.git/hooks/pre-commit.sample") == "protected-path: git directory", rules
    assert "/evil.git/description" not in rules, rules  # the rest of a repository is not a program

    # one already on disk: its config, written by a file tool or a command
    _git("init", "-q", "--bare", str(home / "bare.git"), cwd=home)
    marker = home / "fsmonitor-ran-3"
    payload = (home / "bare.git/config").read_text().replace("bare = true", "bare = false") + \
        f"[core]\n\tworktree = ..\n\tfsmonitor = touch {marker}\n"
    _held(await attacker.call("write_file", file_path=str(home / "bare.git/config"), content=payload,
                              mode="overwrite"), "git directory")
    _held(await attacker.run("tee", str(home / "bare.git/config"), stdin=payload), "git directory")
    _held(await attacker.call("write_file", file_path=str(home / "bare.git/hooks/post-checkout"), content="id"),
          "git directory")
    assert "fsmonitor" not in (home / "bare.git/config").read_text()
    # the pieces in the other order: the config first (no repository yet), then what makes it one
    for n, (tool_head, tool_refs) in enumerate((("write_file", "write_file"), ("tee", "mkdir"))):
        kit = home / f"late{n}"
        wrote = await attacker.call("write_file", file_path=str(kit / "config"), content=payload, create_parents=True)
        assert wrote.ok, _text(wrote)
        if tool_head == "write_file":
            head = await attacker.call("write_file", file_path=str(kit / "HEAD"), content="ref: refs/heads/main\n")
        else:
            head = await attacker.run("tee", str(kit / "HEAD"), stdin="ref: refs/heads/main\n")
        assert head.ok, _text(head)  # a HEAD beside a config alone is no repository yet
        if tool_refs == "write_file":
            refs = await attacker.call("write_file", file_path=str(kit / "refs"), content="")
        else:
            refs = await attacker.run("mkdir", str(kit / "refs"), str(kit / "objects"))
        _held(refs, "git directory")
        assert not (kit / "refs").exists()
    # a checkout rewriting an existing repository's HEAD is not held by this rule
    moved = await attacker.call("write_file", file_path=str(home / "bare.git/HEAD"), content="ref: refs/heads/x\n",
                                mode="overwrite")
    assert moved.ok, _text(moved)
    # what a person would be letting through: a git status inside it (a prompt's, on cd) runs that command
    approved = await attacker.call("write_file", file_path=str(home / "bare.git/config"), content=payload,
                                   mode="overwrite", approved_by="alice")
    assert approved.ok, _text(approved)
    assert _fsmonitor_runs(home / "bare.git", marker), "git did not run the bare repository's config"


# ------------------------------------------------------------------ a submodule's repository under .git/modules


async def test_a_submodules_config_and_hooks_are_held(attacker: Attacker) -> None:
    home = attacker.home
    upstream = home / "upstream"
    upstream.mkdir()
    _git("init", "-q", str(upstream), cwd=home)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "one", cwd=upstream)
    repo = home / "super"
    repo.mkdir()
    _git("init", "-q", str(repo), cwd=home)
    _git("submodule", "add", "-q", str(upstream), "sub", cwd=repo)
    config = repo / ".git/modules/sub/config"
    assert config.is_file() and (repo / "sub/.git").is_file(), "git made no submodule repository here"
    marker = home / "fsmonitor-ran-2"
    payload = config.read_text() + f"[core]\n\tfsmonitor = touch {marker}\n"

    _held(await attacker.run("tee", str(config), stdin=payload), ".git/modules/**/config")
    _held(await attacker.call("write_file", file_path=str(config), content=payload, mode="overwrite"),
          ".git/modules/**/config")
    hook = repo / ".git/modules/sub/hooks/post-checkout"
    _held(await attacker.call("write_file", file_path=str(hook), content="#!/bin/sh\nid\n"), ".git/modules/**/hooks")
    assert f"touch {marker}" not in config.read_text() and not hook.exists()

    approved = await attacker.call("write_file", file_path=str(config), content=payload, mode="overwrite",
                                   approved_by="alice")
    assert approved.ok, _text(approved)
    assert _fsmonitor_runs(repo / "sub", marker), "git did not run the submodule's own config"


# ------------------------------------------------------------------ start-up files of other programs, by class


@pytest.mark.parametrize("place, pattern", [
    ("repo/.hg/hgrc", ".hg/hgrc"),                                         # Mercurial's hooks, per repository
    (".hgrc", "~/.hgrc"),
    ("app/.husky/pre-commit", ".husky"),                                   # hooks kept in the work tree
    ("app/.pre-commit-config.yaml", ".pre-commit-config.yaml"),
    ("app/lefthook.yml", "lefthook.yml"),
    (".bashrc.d/evil.sh", "~/.bashrc.d"),                                  # Fedora's .bashrc sources each
    (".gdbinit", "~/.gdbinit"),                                            # debuggers and interpreters
    ("proj/.Rprofile", ".Rprofile"),
    (".psqlrc", "~/.psqlrc"),
    (".config/starship.toml", "~/.config/starship.toml"),                  # terminals and prompts
    (".config/alacritty/alacritty.toml", "~/.config/alacritty"),
    (".local/share/gnome-shell/extensions/x@y/extension.js", "~/.local/share/gnome-shell/extensions"),
    (".local/share/nautilus/scripts/run", "~/.local/share/nautilus/scripts"),
    (".vscode/extensions/evil/package.json", "~/.vscode/extensions"),      # editors' extensions
    (".config/bspwm/bspwmrc", "~/.config/bspwm"),                          # window managers' start-up
])
async def test_other_programs_start_up_files_are_held(attacker: Attacker, place: str, pattern: str) -> None:
    target = attacker.home / place
    _held(await attacker.call("write_file", file_path=str(target), content="#!/bin/sh\nid\n",
                              create_parents=True), pattern)
    target.parent.mkdir(parents=True, exist_ok=True)
    _held(await attacker.run("tee", str(target), stdin="#!/bin/sh\nid\n"), pattern)
    assert not target.exists()


# ------------------------------------------------------------------ the device's own policy file


async def test_no_tool_reads_or_rewrites_the_devices_policy_file(tmp_path: Path) -> None:
    # the operator keeps the policy beside the work (a write root), given with --policy or the config's
    # device.policy; an agent that rewrote it would start the device next time with rules of its own
    from tether.device.local import open_local_device

    home = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-policy-file-")).resolve()
    rules = "approval:\n  overwrite_outside_temp: false\n  delete: false\nallow_inline_code: false\n"
    wider = "approval: false\nallow_inline_code: true\nunprotect_paths: ['.git/hooks']\n"
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HOME", str(home))
            (home / "work").mkdir()
            by_flag = home / "work/device-policy.yaml"
            by_flag.write_text(rules)
            (home / "conf").mkdir()
            by_config = home / "conf/rules.yaml"
            by_config.write_text(rules)
            config = home / "conf/device.yaml"
            config.write_text("device:\n  policy: rules.yaml\n")
            for policy_file, opened in ((by_flag, {"policy_path": str(by_flag)}), (by_config, {"config": config})):
                async with open_local_device(state_dir=home / ".local/state/tether", **opened) as device:
                    attacker = Attacker(device, home)
                    read = await attacker.call("read_file", file_path=str(policy_file))
                    assert read.status is ResultStatus.FAILURE and read.result.get("rule") == "hide_paths", _text(read)
                    for route in ({"mode": "overwrite"}, {"mode": "append"}):
                        wrote = await attacker.call("write_file", file_path=str(policy_file), content=wider, **route)
                        assert wrote.result.get("rule") == "hide_paths", _text(wrote)
                    cat = await attacker.run("cat", str(policy_file))
                    assert "allow_inline_code" not in json.dumps(cat.result), _text(cat)
                    tee = await attacker.run("tee", str(policy_file), stdin=wider)
                    assert tee.status is ResultStatus.FAILURE, _text(tee)
                    moved = await attacker.call("move_file", source=str(policy_file),
                                                destination=str(home / "work/old.yaml"))
                    assert moved.result.get("rule") == "hide_paths", _text(moved)
                assert policy_file.read_text() == rules, f"{policy_file} was rewritten by the agent"
    finally:
        shutil.rmtree(home, ignore_errors=True)


# ------------------------------------------------------------------ the programs the device itself starts

ANNOTATED = Path(__file__).resolve().parent.parent / "servers" / "annotated.py"


async def test_the_program_of_the_devices_own_mcp_server_is_held() -> None:
    # the device starts this stdio server itself, unsandboxed, at every start: its script lies in a write
    # root (~/tools/srv), so rewriting it (or planting a module beside it) would run the agent's code
    # outside the sandbox next time
    from tether.device.local import open_local_device

    home = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-server-program-")).resolve()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HOME", str(home))
            srv = home / "tools/srv"
            srv.mkdir(parents=True)
            script = srv / "server.py"
            shutil.copy(ANNOTATED, script)
            config = home / "device.yaml"
            config.write_text(json.dumps({
                "device": {"policy": {"approval": {"overwrite_outside_temp": False, "delete": False}}},
                "mcpServers": {"srv": {"command": sys.executable, "args": [str(script)]}}}))
            original = script.read_text()
            evil = "import os\nos.system('id > /tmp/pwned')\n"
            async with open_local_device(config=config, state_dir=home / ".local/state/tether") as device:
                attacker = Attacker(device, home)
                # the rule named is the server's directory (which holds the script)
                _held(await attacker.call("write_file", file_path=str(script), content=evil, mode="overwrite"),
                      str(srv))
                _held(await attacker.run("tee", str(script), stdin=evil), str(srv))
                _held(await attacker.call("write_file", file_path=str(srv / "mcp_types.py"), content=evil), str(srv))
                # the rest of the write root stays the agent's to write
                assert (await attacker.call("write_file", file_path=str(home / "tools/notes.txt"), content="x")).ok
            assert script.read_text() == original and not (srv / "mcp_types.py").exists()
    finally:
        shutil.rmtree(home, ignore_errors=True)


async def test_a_module_in_the_users_site_packages_is_held(attacker: Attacker) -> None:
    # every Python of the user puts this directory ahead of the system's packages: a module planted here
    # shadows one that a system tool imports (tried with the system's own interpreter below)
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.fail(f"{python} is missing; install it with: apt-get install -y python3")
    env = {**os.environ, "HOME": str(attacker.home)}
    env.pop("PYTHONNOUSERSITE", None)
    site = subprocess.run([python, "-c", "import site; print(site.getusersitepackages())"], env=env, check=True,
                          capture_output=True, text=True, timeout=30).stdout.strip()
    module = Path(site) / "shadowed_by_agent.py"
    code = "print('agent code ran')\n"
    _held(await attacker.call("write_file", file_path=str(module), content=code, create_parents=True),
          "~/.local/lib/python*/site-packages")
    Path(site).mkdir(parents=True, exist_ok=True)
    _held(await attacker.run("tee", str(module), stdin=code), "~/.local/lib/python*/site-packages")
    assert not module.exists()
    approved = await attacker.call("write_file", file_path=str(module), content=code, approved_by="alice")
    assert approved.ok, _text(approved)
    ran = subprocess.run([python, "-c", "import shadowed_by_agent"], env=env, cwd="/", capture_output=True,
                         text=True, timeout=30)
    assert "agent code ran" in ran.stdout, f"the system's python did not load the user site: {ran.stderr}"


# ------------------------------------------------------------------ a hard link to a protected file


async def test_a_hard_link_to_a_protected_file_is_refused_and_named_as_one(attacker: Attacker) -> None:
    home = attacker.home
    (home / ".bashrc").write_text("echo user\n")
    (home / "linked").mkdir()
    made = await attacker.run("ln", str(home / ".bashrc"), str(home / "linked/x"))
    assert made.status is ResultStatus.FAILURE and made.result.get("applied") is False, _text(made)
    assert not os.path.lexists(home / "linked/x"), "the hard link reached the real tree"
    assert (home / ".bashrc").stat().st_nlink == 1
    error = made.error or ""
    assert "someone else" not in error, error
    assert f"{home}/linked/x is a hard link the command made to {home}/.bashrc" in error, error
    assert "protected-path: ~/.bashrc" in error, error
    assert made.result["hard_links"] == [{"path": f"{home}/linked/x", "links_to": [f"{home}/.bashrc"],
                                          "rule": "protected-path: ~/.bashrc"}], _text(made)
