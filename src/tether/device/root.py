"""A device running as root: refused unless allowed, and then its sandboxes run as an unprivileged user.

Issue 26, item 7 (docs/security/root.md). As root, a sandbox's user namespace maps host root, so a
command owns every root-owned file: `/etc/shadow`, the server's database, other devices' token files.
`tether device`, `tether exec` and `tether run` (which run a device in this process) refuse to start
as root unless told (`--allow-root`, `TETHER_ALLOW_ROOT=1` or the config's `device: {allow_root: true}`);
allowed, every sandboxed process runs as `run_as` (`TETHER_RUN_AS`, else the config's `device.run_as`,
else `tether` if that user exists, else `nobody`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from tether.device.config import DeviceConfig
from tether.errors import DeviceError
from tether.sandbox.confine.run_as import RunAs, resolve_run_as

ALLOW_ROOT_ENV = "TETHER_ALLOW_ROOT"
RUN_AS_ENV = "TETHER_RUN_AS"
_TRUE = ("1", "true", "yes", "on")


def root_allowed(config: DeviceConfig, flag: bool, env: Mapping[str, str] | None = None) -> bool:
    """Whether running as root was asked for: the flag, TETHER_ALLOW_ROOT=1, or `device.allow_root`."""
    env = os.environ if env is None else env
    return flag or env.get(ALLOW_ROOT_ENV, "").strip().lower() in _TRUE or config.device.allow_root


def run_as_name(config: DeviceConfig, env: Mapping[str, str] | None = None) -> str | None:
    """The run_as setting as given (TETHER_RUN_AS, else `device.run_as`), None for the default."""
    env = os.environ if env is None else env
    return (env.get(RUN_AS_ENV) or "").strip() or config.device.run_as


def run_as_for(config: DeviceConfig, env: Mapping[str, str] | None = None) -> RunAs | None:
    """Who this device's sandboxed processes run as: None when as the device itself (not root, or
    `run_as: root`). Raises ValueError for a user that does not exist."""
    return resolve_run_as(run_as_name(config, env))


def root_check(config: DeviceConfig, flag: bool, command: str, env: Mapping[str, str] | None = None) -> str:
    """"" when not root. As root: the one-line warning to show when allowed (see `root_allowed`).

    Raises `RootRefused` (its message one line) when running as root was not asked for, and ValueError
    for a run_as user that does not exist."""
    if os.geteuid() != 0:
        return ""
    if not root_allowed(config, flag, env):
        raise RootRefused(f"{command} refuses to run as root: its commands could read every root-only file "
                          f"(/etc/shadow, tokens, databases); run it as an ordinary user, or pass --allow-root "
                          f"(or set {ALLOW_ROOT_ENV}=1) to run sandboxed commands as an unprivileged user "
                          f"(docs/security/root.md)")
    run_as = run_as_for(config, env)
    if run_as is None:
        return (f"running as root with run_as: root: sandboxed commands run as root and can read every root-only "
                f"file (set {RUN_AS_ENV} or device.run_as to an unprivileged user)")
    shared = "; nobody is shared with other daemons: better useradd --system tether" if run_as.name == "nobody" else ""
    return (f"running as root: sandboxed commands run as user {run_as.name} (uid {run_as.uid}), who must own or be "
            f"able to write the write roots for commands to change them{shared} (docs/security/root.md)")


class RootRefused(DeviceError, RuntimeError):
    """The process runs as root and was not told it may."""


def demo_run_as(work: Path) -> tuple[str | None, str]:
    """For `tether demo` (CI and a fresh machine run it as root): the run_as its device should use, and a
    line saying so. Not root: (None, ""). Root: the default unprivileged user when its sandbox works here —
    `work` is then handed to it, so its commands can write there — else `root`, with the reason (that user
    cannot run this interpreter, e.g. one under /root)."""
    if os.geteuid() != 0:
        return None, ""
    if os.environ.get(RUN_AS_ENV):  # said explicitly: as it is
        return os.environ[RUN_AS_ENV], ""
    from tether.sandbox.detect import detect

    run_as = resolve_run_as(None)
    if run_as is None:
        return None, ""
    info = detect(run_as=run_as)
    if info.available:
        os.chown(work, run_as.uid, run_as.gid)
        return run_as.name, f"running as root: the demo's commands run as user {run_as.name}, who owns {work}"
    return "root", (f"running as root: the demo's commands run as root, because user {run_as.name} cannot run "
                    f"them here ({info.detail}); see docs/security/root.md")
