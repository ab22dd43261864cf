"""`--allow-root` for the commands that run a device in this process (`tether exec`, `tether run`);
`tether device` has its own (cli/commands/setup/device.py). See tether.device.root and docs/security/root.md.
The check itself (`guard_root`) needs no typer: it lives in `tether.cli.basics`."""

from __future__ import annotations

from typing import Annotated

import typer

from tether.cli.basics import guard_root as guard_root

AllowRootOpt = Annotated[bool, typer.Option(
    "--allow-root", help="run as root (refused otherwise; or TETHER_ALLOW_ROOT=1): sandboxed commands then run as "
                         "the config's device.run_as user (default tether, else nobody)")]
