"""Which sandbox this machine can make, found by trying it once (a probe process), never assumed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass

PROBE_TIMEOUT_S = 10.0
INSTALL_HINT = "install bubblewrap (sudo apt-get install -y bubblewrap) and allow unprivileged user namespaces"


@dataclass(frozen=True, slots=True)
class SandboxInfo:
    """`kind` is what the device profile reports (`bwrap+overlay`, or `none`); `detail` says why."""

    kind: str
    detail: str
    bwrap: str | None = None
    landlock: int = 0  # the Landlock ABI laid under the namespaces (0: none)

    @property
    def available(self) -> bool:
        return self.kind != "none"


def probe_argv(bwrap: str) -> list[str]:
    """The smallest sandbox tether needs: a user namespace that may mount (for the overlays)."""
    return [bwrap, "--unshare-user", "--unshare-pid", "--die-with-parent", "--cap-add", "CAP_SYS_ADMIN",
            "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--", "true"]


def detect() -> SandboxInfo:
    """Try the sandbox once. Costs one short process (a few milliseconds); call it at device start."""
    if not sys.platform.startswith("linux"):
        return SandboxInfo("none", f"no sandbox on {sys.platform}: tether confines processes on Linux only")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return SandboxInfo("none", f"bwrap is not installed: {INSTALL_HINT}")
    try:
        proc = subprocess.run(probe_argv(bwrap), capture_output=True, timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return SandboxInfo("none", f"bwrap could not run: {exc}", bwrap)
    if proc.returncode != 0:
        why = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        return SandboxInfo("none", f"bwrap cannot make a user namespace here ({why[-1] if why else proc.returncode}): "
                                   f"{INSTALL_HINT}", bwrap)
    from tether.sandbox.landlock import abi_version

    abi = abi_version()
    if abi:
        return SandboxInfo("bwrap+landlock+overlay", f"bubblewrap with user, mount, pid namespaces, Landlock ABI {abi} "
                           "under them; writes captured in an overlay", bwrap, abi)
    return SandboxInfo("bwrap+overlay", "bubblewrap with user, mount, pid namespaces (no Landlock in this kernel); "
                       "writes captured in an overlay", bwrap)
