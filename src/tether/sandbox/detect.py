"""Which sandbox this machine can make, found by trying it once (a probe process), never assumed."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
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


def _probe(bwrap: str) -> str | None:
    """Run what every command needs once (namespaces, an overlay written through, capabilities
    dropped) under the warden's own bwrap arguments; None when it works, else what went wrong."""
    from tether.sandbox.bwrap import warden_argv
    from tether.sandbox.spec import SandboxSpec

    base = tempfile.mkdtemp(prefix="tether-probe-", dir="/var/tmp" if os.access("/var/tmp", os.W_OK) else None)
    try:
        for sub in ("lower", "0/u", "0/w"):
            os.makedirs(os.path.join(base, sub))
        argv = warden_argv(SandboxSpec(layers_dir=base), sys.executable, 0, bwrap=bwrap)
        argv[-1:] = ["--probe", base]  # the warden's probe mode instead of its socket
        proc = subprocess.run(argv, capture_output=True, timeout=PROBE_TIMEOUT_S, check=False,
                              env={"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not run: {exc}"
    finally:
        for work in (os.path.join(base, "0", "w", "work"),):
            with contextlib.suppress(OSError):
                os.chmod(work, 0o700)
        shutil.rmtree(base, ignore_errors=True)
    if proc.returncode != 0:
        why = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        return why[-1] if why else f"exit code {proc.returncode}"
    return None


def detect() -> SandboxInfo:
    """Try the sandbox once. Costs one short sandbox with an interpreter (tens of milliseconds): call it
    at device start (in a thread), not per command."""
    if not sys.platform.startswith("linux"):
        return SandboxInfo("none", f"no sandbox on {sys.platform}: tether confines processes on Linux only")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return SandboxInfo("none", f"bwrap is not installed: {INSTALL_HINT}")
    problem = _probe(bwrap)
    if problem is not None:
        return SandboxInfo("none", f"bwrap cannot confine commands here ({problem}): {INSTALL_HINT}", bwrap)
    from tether.sandbox.landlock import abi_version

    abi = abi_version()
    if abi:
        return SandboxInfo("bwrap+landlock+overlay", f"bubblewrap with user, mount, pid namespaces, Landlock ABI {abi} "
                           "under them; writes captured in an overlay", bwrap, abi)
    return SandboxInfo("bwrap+overlay", "bubblewrap with user, mount, pid namespaces (no Landlock in this kernel); "
                       "writes captured in an overlay", bwrap)
