"""The device state directory's lock for the commands that use a state directory in their own process (`tether
run` on this machine, `--dry-run` too, a local `tether exec`, `tether tools`, `tether undo --local`, `tether mcp
serve`, `tether tools serve`): the same lock `tether device` holds (`tether.device.local.hold_state_dir`), so that
no two processes share one undo journal, one private /tmp base and one set of sessions' totals. A second one is
refused in one line naming the first (exit code 2, through `SystemExit`: neither typer nor click is imported
here, for `tether exec`'s fast path). The commands that only read there (`tether sessions`, `tether tasks` and
`tether log` on this machine) take no lock: what they read is appended in whole lines or kept in SQLite, and
they write nothing."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from tether.cli.basics import ExitCode
from tether.cli.views.safe_text import say

if TYPE_CHECKING:
    from tether.device.config import DeviceConfig
    from tether.device.local import StateDirBusy


def device_state(config: DeviceConfig, state_dir: Path | None) -> Path:
    """The state directory a local device built from `config` (`tether.cli.basics.load_config`) and
    `--state-dir` uses (`device_state_dir`: `--state-dir`, the config's `device.state_dir`, $TETHER_STATE_DIR,
    ~/.local/state/tether)."""
    from tether.device.local import device_state_dir

    return device_state_dir(config, state_dir)


BRIEF_HOLDERS = frozenset({"tether exec", "tether tools", "tether undo"})  # one-off calls: a second one waits
# for the first rather than fail


@contextmanager
def holding_state_dir(directory: Path, holder: str, *, wait_s: float = 0.0,
                      refusal: Callable[[StateDirBusy], str] | None = None) -> Iterator[None]:
    """Hold `directory`'s lock while the block runs, as `holder` (e.g. "tether run": what a refused second
    process is told holds it). When another live process holds it, the command fails before the block runs
    (exit code 2, one line on stderr naming that process's pid: the lock's own words, or `refusal(busy)`'s),
    having read or written nothing there; likewise when its lock cannot be taken for another reason, but for a
    directory that does not exist and cannot be made (a read-only home): no other process can be using it, and
    the block runs without it.

    `wait_s` > 0: while the holder is a one-off call (`BRIEF_HOLDERS`: another local `tether exec`, `tether
    tools`, `tether undo`), wait for it to end, up to `wait_s` seconds, rather than fail (scripts run local calls
    side by side), and likewise while the holder has taken the lock but not yet written what it is (a look after
    the pause names it); a long-running holder (`tether device`, `tether run`, a serve, an API user) is refused
    at once, as is a brief one still there at the end."""
    from tether.device.local import StateDirBusy, hold_state_dir_if_any
    from tether.errors import DeviceError

    deadline = time.monotonic() + wait_s
    pause = 0.005
    while True:
        try:
            fd = hold_state_dir_if_any(directory, holder)
            break
        except StateDirBusy as exc:
            brief = exc.holder in BRIEF_HOLDERS or exc.starting  # starting: taken an instant ago, not yet named
            if not brief or time.monotonic() + pause > deadline:
                _refuse(refusal(exc) if refusal is not None else str(exc))
            time.sleep(pause)  # flock has no timeout of its own: try again shortly, within the bound
            pause = min(pause * 2, 0.1)
        except DeviceError as exc:
            _refuse(str(exc))
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _refuse(message: str) -> NoReturn:
    say(f"error: {message}", err=True, soft_wrap=True)  # one line, whatever the width
    raise SystemExit(int(ExitCode.USAGE)) from None
