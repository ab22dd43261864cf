"""Programs a tool leaves in a project's own program directories: allowed, and named in its result.

A project's virtual environment `bin/` (`Scripts\\` on Windows: a directory beside a `pyvenv.cfg`) and a
`node_modules/.bin/` hold the programs the project's own tooling later runs by name (an activated venv's
`pytest`, `npm test` running `node_modules/.bin/jest`). They are not protected paths: every `pip install`
and `npm install` writes them, so holding them would hold every install. Instead the result of the tool that
created, changed or moved one there lists it under `left_programs` (a shell command's applied changes, a
`write_file`, a `move_file`), so whoever reads the result or the audit sees what was left behind for the
project to run. A deletion is not listed (nothing is left to run), and neither is a write by a live process
(a sandboxed MCP server, a `live_write_roots` command): those leave no change list to read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

_VENV_BINS = ("bin", "Scripts")


def program_place(path: str, venvs: dict[str, bool] | None = None) -> bool:
    """Whether `path` (absolute) lies directly in a `node_modules/.bin` or a virtual environment's `bin/`
    (a directory whose parent holds `pyvenv.cfg`, looked at on disk). `venvs` caches that look per
    directory across calls. Never raises."""
    parent = os.path.dirname(path)
    name, above = os.path.basename(parent), os.path.dirname(parent)
    if name == ".bin":
        return os.path.basename(above) == "node_modules"
    if name not in _VENV_BINS:
        return False
    if venvs is None:
        venvs = {}
    if above not in venvs:
        venvs[above] = os.path.isfile(os.path.join(above, "pyvenv.cfg"))
    return venvs[above]


def left_programs(changes: Iterable[tuple[str, str]]) -> list[str]:
    """Of `changes` (each a path and its kind: created, modified, renamed or deleted), the paths left in a
    program place (`program_place`), in order; deletions are not listed."""
    venvs: dict[str, bool] = {}
    return [path for path, kind in changes if kind != "deleted" and program_place(path, venvs)]


__all__ = ["left_programs", "program_place"]
