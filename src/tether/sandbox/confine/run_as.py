"""Who a root device's sandboxed processes run as (docs/security/root.md).

A device running as root would start bubblewrap as root, and the sandbox's user namespace would then
map host root: a command, capabilities dropped or not, owns every root-owned file (`/etc/shadow`, the
server's database, other devices' token files). So a root device starts every sandbox — the warden,
live processes, the probe — as an unprivileged user instead (`run_as`), through `setpriv` with no
supplementary groups. A device that is not root runs its sandbox as itself: there is nobody to drop to.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
from dataclasses import dataclass

DEDICATED_USER = "tether"  # `useradd --system tether`: a user nothing else runs as
FALLBACK_USER = "nobody"


@dataclass(frozen=True, slots=True)
class RunAs:
    """An unprivileged identity for sandboxed processes: `name` (for messages), `uid`, `gid`."""

    name: str
    uid: int
    gid: int

    def reaches(self, path: str) -> bool:
        """Whether this user can look up `path`: every directory above it searchable by its uid or its one
        group (it has no other), by the mode bits. bwrap, started as this user, can mount nothing on a path
        it cannot reach, and a command of it cannot read there either: such a path needs no mask."""
        parent = os.path.dirname(os.path.abspath(path))
        while True:
            try:
                st = os.stat(parent)
            except OSError:
                return False
            bit = stat.S_IXUSR if st.st_uid == self.uid else stat.S_IXGRP if st.st_gid == self.gid else stat.S_IXOTH
            if not st.st_mode & bit:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)

    def argv_prefix(self) -> list[str]:
        """What goes before `bwrap` so that it starts as this user, its group, and no supplementary groups."""
        setpriv = shutil.which("setpriv") or "setpriv"
        return [setpriv, f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--"]


def default_user() -> str:
    """`tether` when that system user exists, else `nobody` (shared with other daemons: see the docs)."""
    try:
        pwd.getpwnam(DEDICATED_USER)
        return DEDICATED_USER
    except KeyError:
        return FALLBACK_USER


def resolve_run_as(name: str | None) -> RunAs | None:
    """The identity sandboxed processes run as: None means "as this process" (not root, or `run_as: root`).

    `name` is a user name or a numeric uid (None: `default_user()`). Raises ValueError for a user that
    does not exist or is root (uid 0 by another name is `root`, said explicitly)."""
    if os.geteuid() != 0:
        return None
    name = (name or default_user()).strip()
    if name == "root":
        return None
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, ValueError):
        raise ValueError(f"run_as: no user {name!r} on this machine (create it: useradd --system {name}, "
                         f"or name another)") from None
    if entry.pw_uid == 0:
        raise ValueError(f"run_as: {name!r} is uid 0, i.e. root; write run_as: root to mean that")
    return RunAs(entry.pw_name, entry.pw_uid, entry.pw_gid)
