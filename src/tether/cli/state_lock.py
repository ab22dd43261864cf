"""The device state directory's lock for the commands that run a device in their own process (`tether run` on
this machine, a local `tether exec`, `tether mcp serve`, `tether tools serve`): the same lock `tether device`
holds (`tether.device.local.hold_state_dir`), so that no two processes share one undo journal, one private /tmp
base and one set of sessions' totals. A second one is refused in one line naming the first (exit code 2, through
`SystemExit`: neither typer nor click is imported here, for `tether exec`'s fast path)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from tether.cli.basics import ExitCode, usage_error
from tether.cli.views.safe_text import say


def device_state(config: Path | None, state_dir: Path | None) -> Path:
    """The state directory a local device built from `config` and `--state-dir` uses (`device_state_dir`:
    `--state-dir`, the config's `device.state_dir`, $TETHER_STATE_DIR, ~/.local/state/tether). A config that
    cannot be read fails the command (exit code 2)."""
    from tether.device.config import load_device_config
    from tether.device.local import device_state_dir

    try:
        return device_state_dir(load_device_config(config), state_dir)
    except ValueError as exc:
        usage_error(str(exc), ExitCode.USAGE)


@contextmanager
def holding_state_dir(directory: Path, holder: str) -> Iterator[None]:
    """Hold `directory`'s lock while the block runs, as `holder` (e.g. "tether run": what a refused second
    process is told holds it). When another live process holds it, the command fails before the block runs
    (exit code 2, one line on stderr naming that process's pid), having read or written nothing there; likewise
    when its lock cannot be taken for another reason, but for a directory that does not exist and cannot be
    made (a read-only home): no other process can be using it, and the block runs without it."""
    from tether.device.local import StateDirBusy, hold_state_dir
    from tether.errors import DeviceError

    try:
        fd: int | None = hold_state_dir(directory, holder)
    except StateDirBusy as exc:
        _refuse(exc)
    except DeviceError as exc:
        if directory.exists():
            _refuse(exc)
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _refuse(exc: Exception) -> NoReturn:
    say(f"error: {exc}", err=True, soft_wrap=True)  # one line, whatever the width
    raise SystemExit(int(ExitCode.USAGE)) from None
