"""What a `run` or `prime` request tells the warden of a command's mounts, IPC filters and limits."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tether.sandbox.confine.bwrap import live_source, tmp_source, unix_socket_paths
from tether.sandbox.confine.guard import live_plan
from tether.sandbox.confine.spec import ANY_SOCKET
from tether.sandbox.runner.state import (
    NO_LIVE,
    SandboxParts,
)


def x_display(socket_path: str) -> bool:
    """Whether a launched program's display socket is an X server's (/tmp/.X11-unix/X<n>), whose client
    library tries an abstract address first; a Wayland compositor's is reached by its path alone."""
    return os.path.dirname(socket_path) == "/tmp/.X11-unix"


class Requests(SandboxParts):
    """The mounts, IPC filters and limits of a warden request."""

    def _mounts(self, layer: Path | None, display: tuple[str, ...] = (), own_tmp: bool = False) -> dict[str, Any]:
        """The part of a `run` request that decides the command's mounts (warden `PRIMED_BY`), its Landlock
        rules, IPC filters and limits. `own_tmp`: the command gets its session's private /tmp (read-only
        without a `layer`); a captured command always has what it needs for one."""
        # live roots are written directly: hidden and protected paths there stay uncreatable
        guard = live_plan(self.spec.live_write_roots, self.spec.hidden, self.spec.protected,
                          self.spec.protected_names, depth=1) if self.spec.live_write_roots else NO_LIVE
        # the sessions' /tmp base is hidden from an uncaptured command (through the machine's /tmp it would
        # reach every session's); a captured one without a session has it hidden by `mounts.bind_tmp`
        base = None if self.private_tmp is None or layer is not None else self.private_tmp.made
        return {"hidden": [*self.spec.hidden] if base is None else sorted({*self.spec.hidden, base}),
                "live": [(live_source(self.spec, i), root) for i, root in enumerate(self.spec.live_write_roots)
                         if self.spec.run_as is None or self.spec.run_as.reaches(root)],
                "layers_dir": self.spec.layers_dir,
                "freeze": guard.freeze, "readonly": guard.readonly,
                "layer": None if layer is None else {"dir": str(layer), "roots": list(self.spec.write_roots)},
                "landlock": self.info.landlock,  # the Landlock ABI, and where the command may write
                "writable": [*(self.spec.write_roots if layer is not None else ()), *self.spec.live_write_roots,
                             "/dev"],
                **self._private_tmp(layer is not None or own_tmp), **self._ipc_and_limits(display)}

    def _private_tmp(self, wanted: bool) -> dict[str, Any]:
        """Where a command's namespace finds the sessions' private /tmp directories (`mounts.hold_tmp`): the
        base as the warden sees it, the temp dir they replace, and the paths below it that stay; nothing
        when the command is not `wanted` to get its session's (or there is none)."""
        private = self.private_tmp
        if private is None or not wanted:
            return {}
        keep = [[path, path] for path in private.keep
                if path not in self.spec.live_write_roots and path not in private.captured]
        keep += [[root, live_source(self.spec, i)] for i, root in enumerate(self.spec.live_write_roots)
                 if private.is_kept(root) and (self.spec.run_as is None or self.spec.run_as.reaches(root))]
        return {"private_tmp": {"base": tmp_source(self.spec), "target": private.tmp, "keep": keep,
                                "captured": list(private.captured), "path": private.base}}

    def _ipc_and_limits(self, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        """What the warden needs to close IPC and cap resources for one command (see seccomp, limits)."""
        if not self.filters:
            return {"filters": False}
        allowed = (*self.spec.allow_sockets, *extra) if extra else self.spec.allow_sockets
        any_socket = ANY_SOCKET in allowed
        masks: list[str] = []
        if allowed and not any_socket:
            masks = [p for p in unix_socket_paths() if os.path.realpath(p) not in allowed]
        return {"allow_unix": bool(allowed), "any_socket": any_socket, "mask_sockets": masks, **self._limits}
