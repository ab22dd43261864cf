"""Real paths kept on a policy between calls (tether.tools.policy.real_paths): the resolver agrees with
os.path.realpath, and a kept result is never used once the filesystem says otherwise — attacked through
the file tools with one policy object reused across calls, as a device does."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from tests.kits.results import failed, ok
from tether.protocol.models import Result
from tether.tools.context import ToolContext
from tether.tools.files.tool import files_toolset
from tether.tools.policy.model import Policy
from tether.tools.policy.real_paths import RealPaths, traced_realpath


def _tree(tmp_path: Path) -> list[str]:
    """Links of every kind a resolver can get wrong: relative, absolute, chained, `..` after a link,
    a loop, a dangling link and a link to a missing parent."""
    (tmp_path / "a/b/c").mkdir(parents=True)
    (tmp_path / "rel").symlink_to("a/b")
    (tmp_path / "abs").symlink_to(tmp_path / "a")
    (tmp_path / "chain").symlink_to("rel/c")
    (tmp_path / "a/b/up").symlink_to("../..")
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    (tmp_path / "dangling").symlink_to("nowhere/deeper")
    return [str(tmp_path / p) for p in (
        "a/b/c", "rel/c/x", "abs/b/../b/c", "chain/new/file", "rel/up/abs/b", "rel/../x", "loop1/x", "dangling/y",
        "missing/../a", "a/./b//c/", ".")] + ["/", "/nonexistent/x/.."]


def test_the_traced_resolver_is_realpath_and_shares_lookups(tmp_path: Path) -> None:
    paths = _tree(tmp_path)
    trace: dict[str, bool | str] = {}
    assert [traced_realpath(p, trace) for p in paths] == [os.path.realpath(p) for p in paths]
    kept = RealPaths.of(paths)
    assert kept.holds() and len(kept.trace) == len({path for path, _ in kept.trace})


@pytest.mark.parametrize("change", ["new link", "link retargeted", "link removed", "dir made link"])
def test_a_kept_result_stops_holding_when_any_traced_path_changes(tmp_path: Path, change: str) -> None:
    (tmp_path / "d/inner").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "ln").symlink_to(tmp_path / "d")
    kept = RealPaths.of([str(tmp_path / "ln/inner/x"), str(tmp_path / "new/x"), str(tmp_path / "d/inner")])
    assert kept.holds()
    if change == "new link":
        (tmp_path / "new").symlink_to(tmp_path / "other")
    elif change == "link retargeted":
        (tmp_path / "ln").unlink()
        (tmp_path / "ln").symlink_to(tmp_path / "other")
    elif change == "link removed":
        (tmp_path / "ln").unlink()
        (tmp_path / "ln").mkdir()
    else:
        (tmp_path / "d").rename(tmp_path / "d2")
        (tmp_path / "d").symlink_to(tmp_path / "d2")
    assert not kept.holds()
    fresh = RealPaths.of(kept.paths)
    assert fresh.real == tuple(os.path.realpath(p) for p in kept.paths) and fresh.holds()


# ------------------------------------------------------------------------------------------ through the tools


class Device:
    """One policy and context reused across calls (the memo lives on the policy), as a device keeps them."""

    def __init__(self, root: Path, **policy: Any) -> None:
        self.policy = Policy(read_roots=[str(root)], write_roots=[str(root)], **policy)
        self.ctx = ToolContext(policy=self.policy, temp_dir=str(root / "tmp"))

    def call(self, name: str, **args: Any) -> Result:
        return asyncio.run(files_toolset().call(name, args, self.ctx))


def _denied(result: Result, rule: str) -> None:
    failed(result, rule)


def test_a_hidden_path_created_after_the_first_call_is_hidden_at_once(tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "vault").mkdir()
    (tmp_path / "vault/id").write_text("secret")
    device = Device(tmp_path, hide_paths=[str(tmp_path / "home/.keys")])
    assert ok(device.call("read_file", file_path=str(tmp_path / "vault/id")))  # the memo holds .keys missing
    (tmp_path / "home/.keys").symlink_to(tmp_path / "vault")  # someone puts the hidden path there, as a link
    _denied(device.call("read_file", file_path=str(tmp_path / "vault/id")), "hide_paths")
    _denied(device.call("file_info", path=str(tmp_path / "vault/id")), "hide_paths")
    assert "vault" not in [e["name"] for e in ok(device.call("list_dir", path=str(tmp_path)))["entries"]]


def test_a_hidden_link_swapped_between_calls_hides_its_new_target(tmp_path: Path) -> None:
    for name in ("old", "new"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(name)
    (tmp_path / "keys").symlink_to(tmp_path / "old")
    device = Device(tmp_path, hide_paths=[str(tmp_path / "keys")])
    _denied(device.call("read_file", file_path=str(tmp_path / "old/f")), "hide_paths")
    assert ok(device.call("read_file", file_path=str(tmp_path / "new/f")))
    (tmp_path / "keys").unlink()
    (tmp_path / "keys").symlink_to(tmp_path / "new")
    _denied(device.call("read_file", file_path=str(tmp_path / "new/f")), "hide_paths")
    _denied(device.call("write_file", file_path=str(tmp_path / "new/g"), content="x"), "hide_paths")
    assert ok(device.call("read_file", file_path=str(tmp_path / "old/f")))


def test_a_parent_of_a_hidden_path_replaced_by_a_link_moves_the_hidden_path(tmp_path: Path) -> None:
    (tmp_path / "home/.config").mkdir(parents=True)
    (tmp_path / "dotfiles/config/gcloud").mkdir(parents=True)
    (tmp_path / "dotfiles/config/gcloud/creds").write_text("token")
    device = Device(tmp_path, hide_paths=[str(tmp_path / "home/.config/gcloud")])
    assert ok(device.call("file_info", path=str(tmp_path / "dotfiles/config/gcloud/creds")))
    (tmp_path / "home/.config").rmdir()
    (tmp_path / "home/.config").symlink_to(tmp_path / "dotfiles/config")
    _denied(device.call("read_file", file_path=str(tmp_path / "dotfiles/config/gcloud/creds")), "hide_paths")


def test_a_root_replaced_by_a_link_is_judged_where_it_now_leads(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(name)
    (tmp_path / "root").symlink_to(tmp_path / "a")
    device = Device(tmp_path / "root")
    assert ok(device.call("read_file", file_path=str(tmp_path / "a/f")))
    _denied(device.call("read_file", file_path=str(tmp_path / "b/f")), "read_roots")
    (tmp_path / "root").unlink()
    (tmp_path / "root").symlink_to(tmp_path / "b")
    _denied(device.call("read_file", file_path=str(tmp_path / "a/f")), "read_roots")
    assert ok(device.call("read_file", file_path=str(tmp_path / "b/f")))


def test_a_protected_place_whose_parent_becomes_a_link_still_asks_a_person(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    (home / ".config").mkdir(parents=True)
    (tmp_path / "dotfiles/autostart").mkdir(parents=True)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("HOME", str(home))
    device = Device(tmp_path)
    target = str(tmp_path / "dotfiles/autostart/evil.desktop")
    assert ok(device.call("write_file", file_path=str(tmp_path / "tmp/warm"), content="x"))
    (home / ".config").rmdir()
    (home / ".config").symlink_to(tmp_path / "dotfiles")
    failed(device.call("write_file", file_path=target, content="[Desktop Entry]"),
           "protected-path: ~/.config/autostart")
    assert not os.path.exists(target)
