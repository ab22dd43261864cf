"""The pattern language of protected paths and the hidden-path checks (tether.tools.policy.path_rules), as a table."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tether.tools.policy.hidden import HiddenSet
from tether.tools.policy.model import Policy, policy_from_mapping
from tether.tools.policy.path_rules import DEFAULT_PROTECTED, Matcher, protected_patterns

PATTERNS = ["~/.bashrc", ".git/hooks", ".git/config", "*.pth", "~/.cargo/config*", "/etc/crontab",
            ".git/worktrees/*/config.worktree", "~/.config/systemd/user", "**/foo/bar", ".vscode/mcp.json"]


@pytest.mark.parametrize(("path", "expected"), [
    ("~/.bashrc", "~/.bashrc"), ("~/.BASHRC", "~/.bashrc"), ("~/.bashrcx", None), ("~/x/.bashrc", None),
    ("/r/y/.git/hooks/pre-commit", ".git/hooks"), ("/r/.git/hooks", ".git/hooks"), ("/r/.git/hooksy", None),
    ("/r/.git/config", ".git/config"), ("/r/.git/configx", None), ("/r/.git", None),
    ("/usr/lib/python3/site-packages/zz.pth", "*.pth"), ("/x.pth", "*.pth"), ("/x.pthx", None),
    ("~/.cargo/config.toml", "~/.cargo/config*"), ("~/.cargo/bin/x", None),
    ("/etc/crontab", "/etc/crontab"), ("/etc/crontabs", None),
    ("/r/.git/worktrees/w/config.worktree", ".git/worktrees/*/config.worktree"),
    ("~/.config/systemd/user/evil.service", "~/.config/systemd/user"), ("~/.config/systemd", None),
    ("/a/foo/bar/baz", "**/foo/bar"), ("/a/.VSCODE/mcp.json", ".vscode/mcp.json"), ("/", None),
])
def test_patterns_match_the_path_and_what_lies_beneath(path: str, expected: str | None) -> None:
    assert Matcher.of(PATTERNS).match(os.path.expanduser(path)) == expected


def test_an_anchored_pattern_also_matches_where_its_directory_really_lies(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dotfiles/config").mkdir(parents=True)
    (tmp_path / "home").mkdir()
    (tmp_path / "home/.config").symlink_to(tmp_path / "dotfiles/config")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    real = os.path.realpath(tmp_path / "home/.config/autostart/x.desktop")
    assert Matcher.of(["~/.config/autostart"]).match(real) == "~/.config/autostart"


def test_unprotect_names_defaults_exactly_and_protected_paths_add() -> None:
    policy = policy_from_mapping({"unprotect_paths": [".git/config"], "protected_paths": ["Makefile"]})
    patterns = protected_patterns(policy)
    assert ".git/config" not in patterns and "Makefile" in patterns and ".git/hooks" in patterns
    assert len(patterns) == len(DEFAULT_PROTECTED)
    with pytest.raises(ValueError, match="not a default protected path"):
        policy_from_mapping({"unprotect_paths": ["~/.BASHRC"]})


def test_hidden_set_covers_the_entry_beneath_it_and_nothing_beside_it(tmp_path: Path) -> None:
    hidden = HiddenSet.of(Policy(hide_paths=[str(tmp_path / "keys")]), [str(tmp_path / "device.token")])
    assert hidden.by(tmp_path / "keys") == str(tmp_path / "keys")
    assert hidden.by(tmp_path / "KEYS/id") == str(tmp_path / "keys")
    assert hidden.by(tmp_path / "keys2") is None and hidden.by(tmp_path) is None
    assert "device's own" in (hidden.by(tmp_path / "device.token") or "")
    assert hidden.inside(tmp_path) is not None and hidden.inside(tmp_path / "other") is None
