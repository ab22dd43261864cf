"""`--allow-root` for the commands that run a device in this process (`tether exec`, `tether run`);
`tether device` has its own (cli/commands/setup/device.py). See tether.device.root and docs/security/root.md."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tether.cli.common import ExitCode, say

AllowRootOpt = Annotated[bool, typer.Option(
    "--allow-root", help="run as root (refused otherwise; or TETHER_ALLOW_ROOT=1): sandboxed commands then run as "
                         "the config's device.run_as user (default tether, else nobody)")]


def guard_root(config: Path | None, allow_root: bool, command: str) -> None:
    """Not root: nothing. Root without leave: one line on stderr and the usage-error exit code. Root with
    leave: a one-line warning naming who sandboxed commands run as."""
    import os

    if os.geteuid() != 0:
        return
    from tether.device.config import load_device_config
    from tether.device.root import RootRefused, root_check

    try:
        warning = root_check(load_device_config(config), allow_root, command)
    except (ValueError, RootRefused) as exc:
        say(f"error: {exc}", err=True, soft_wrap=True)  # one line, whatever the terminal's width
        raise typer.Exit(ExitCode.USAGE) from None
    if warning:
        say(f"warning: {warning}", err=True, soft_wrap=True)
