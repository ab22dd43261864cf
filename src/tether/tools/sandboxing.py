"""The device's sandbox from its policy: which roots are captured, what is hidden, where layers live.

Kept apart from `tether.sandbox` (which knows nothing of policies) so the mechanism stays a small
library and the rules that feed it stay with the other rules.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from tether.sandbox import SandboxInfo, SandboxSpec, detect
from tether.sandbox.limits import Limits
from tether.sandbox.runner import Sandbox
from tether.sandbox.spec import under
from tether.tools.policy import Policy

logger = logging.getLogger(__name__)


def layers_dir(roots: Iterable[str]) -> str | None:
    """A private directory for overlay layers, outside every root (an overlay may not contain its own layer).

    $TETHER_SANDBOX_LAYERS, else /var/tmp, else /dev/shm (memory), whichever lies outside the roots.
    """
    real_roots = [os.path.realpath(os.path.expanduser(r)) for r in roots]
    candidates = [os.environ.get("TETHER_SANDBOX_LAYERS", ""), "/var/tmp", "/dev/shm", tempfile.gettempdir()]
    for base in filter(None, candidates):
        real = os.path.realpath(base)
        path = real if base == candidates[0] else os.path.join(real, f"tether-layers-{os.getuid()}")
        place = os.path.realpath(path)
        if under(place, real_roots) or any(under(r, [place]) for r in real_roots) or not os.access(real, os.W_OK):
            continue
        try:
            Path(path).mkdir(mode=0o700, exist_ok=True)
            if os.lstat(path).st_uid != os.getuid() or os.path.islink(path):
                continue
            os.chmod(path, 0o700)
        except OSError:
            continue
        return path
    return None


def sandbox_spec(policy: Policy, *, hidden: Iterable[str] = (), layers: str = "") -> SandboxSpec:
    live = list(policy.live_write_roots)
    live_real = [os.path.realpath(os.path.expanduser(p)) for p in live]
    captured = [r for r in policy.write_roots if os.path.realpath(os.path.expanduser(r)) not in live_real]
    return SandboxSpec.build(write_roots=[r for r in captured if os.path.isdir(os.path.expanduser(r))],
                             live_write_roots=[p for p in live if os.path.isdir(os.path.expanduser(p))],
                             hidden=[*policy.hide_paths, *hidden], network=policy.network, layers_dir=layers,
                             allow_sockets=list(policy.allow_sockets), limits=Limits(**policy.limits.model_dump()))


def make_sandbox(policy: Policy, *, hidden: Iterable[str] = (), info: SandboxInfo | None = None) -> Sandbox | None:
    """The device's sandbox, or None (with the reason logged) where none can be made here."""
    info = info or detect()
    if not info.available:
        logger.warning("no sandbox: %s", info.detail)
        return None
    layers = layers_dir(policy.write_roots)
    if layers is None:
        logger.warning("no sandbox: no writable directory outside the write roots for its layers "
                       "(set TETHER_SANDBOX_LAYERS)")
        return None
    return Sandbox(info, sandbox_spec(policy, hidden=hidden, layers=layers))
