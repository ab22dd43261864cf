"""Whether a command's layer holds nothing, and removing the directories an overlay left."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path


def remove_all(paths: list[Path]) -> None:
    """Remove directories an overlay left (its work directories are mode 000: opened up on the way down),
    with the `<name>-<n>` ones set aside beside them (`mounts.set_aside`)."""
    for path in [*paths, *(aside for named in paths for aside in named.parent.glob(f"{named.name}-*"))]:
        if not path.exists():
            continue
        with contextlib.suppress(OSError):
            os.chmod(path, 0o700)
        for base, dirs, _ in os.walk(path):
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(base, name), 0o700)
        shutil.rmtree(path, ignore_errors=True)


def layer_empty(layer: Path, roots: int | tuple[str, ...], hidden: tuple[str, ...] = ()) -> bool:
    """Whether the command wrote nothing, checked without a scan: its upper directories are empty, or
    (given the roots by path and the hidden paths) hold nothing but the whiteouts the warden planted over
    hidden paths and the directories above them (`mounts.plant_whiteouts`)."""
    count = roots if isinstance(roots, int) else len(roots)
    try:
        if not hidden or isinstance(roots, int):
            return all(not os.listdir(layer / str(i) / "u") for i in range(count))
        planted = frozenset(hidden)
        return all(_only_planted(str(layer / str(i) / "u"), root.rstrip("/"), planted) for i, root in enumerate(roots))
    except OSError:
        return False


def _only_planted(upper: str, real: str, hidden: frozenset[str]) -> bool:
    with os.scandir(upper) as entries:
        for entry in entries:
            path = f"{real}/{entry.name}"
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0 and path in hidden:
                continue
            above_hidden = stat.S_ISDIR(st.st_mode) and any(h.startswith(path + "/") for h in hidden)
            if above_hidden and os.path.isdir(path) and not os.path.islink(path) and not _opaque(entry.path) \
                    and _only_planted(entry.path, path, hidden):
                continue  # planted only above a real directory; a new one is the command's
            return False
    return True


def _opaque(path: str) -> bool:
    for name in ("user.overlay.opaque", "trusted.overlay.opaque"):
        with contextlib.suppress(OSError):
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
    return False
