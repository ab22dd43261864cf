"""Which sandbox this machine can make, found by trying it once (a probe process), never assumed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tether.sandbox.confine.run_as import RunAs

PROBE_TIMEOUT_S = 10.0
CACHE_FILE = "sandbox-probe.json"
_CACHE_MAX_BYTES = 64 * 1024
# What decides whether an unprivileged user may make namespaces, besides the kernel and bwrap themselves.
_USERNS_KNOBS = ("/proc/sys/kernel/unprivileged_userns_clone", "/proc/sys/user/max_user_namespaces",
                 "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
                 "/proc/sys/kernel/unprivileged_userns_apparmor_policy")
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


def _probe(bwrap: str, run_as: RunAs | None = None) -> str | None:
    """Run what every command needs once (namespaces, an overlay written through, capabilities
    dropped) under the warden's own bwrap arguments, as `run_as` when given (a root device's
    sandbox user); None when it works, else what went wrong."""
    from tether.sandbox.confine.bwrap import warden_argv
    from tether.sandbox.confine.spec import SandboxSpec

    base = tempfile.mkdtemp(prefix="tether-probe-", dir="/var/tmp" if os.access("/var/tmp", os.W_OK) else None)
    try:
        for sub in ("lower", "0/u", "0/w"):
            os.makedirs(os.path.join(base, sub))
        if run_as is not None:  # the layers directory is that user's, as the device's own is (runner/layers.py)
            for where, dirs, _ in os.walk(base):
                for path in (where, *(os.path.join(where, d) for d in dirs)):
                    os.chown(path, run_as.uid, run_as.gid)
        argv = warden_argv(SandboxSpec(layers_dir=base, run_as=run_as), sys.executable, 0, bwrap=bwrap)
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
        problem = why[-1] if why else f"exit code {proc.returncode}"
        if run_as is not None:
            problem += (f"; it ran as the device's run_as user {run_as.name} (uid {run_as.uid}), who must be able to "
                        f"run {sys.executable} and read tether's files (docs/security/root.md)")
        return problem
    return None


def detect(cache_dir: str | os.PathLike[str] | None = None, *, run_as: RunAs | None = None) -> SandboxInfo:
    """Try the sandbox once. Costs one short sandbox with an interpreter (a process on the start-up path
    of every `tether device` and `tether exec`): call it at start (in a thread), not per command.

    With `cache_dir` (the device's state directory, which sandboxed commands never see), a sandbox that
    worked is remembered for this boot, kernel, bwrap binary, interpreter, probe code, user and the
    user-namespace sysctls: the probe runs again when any of them changes. A failed probe is never
    remembered, so a machine that gets fixed is seen fixed at its next start. `run_as`: a root device's
    sandbox user (tether.sandbox.confine.run_as); the probe runs as that user, and its uid is part of the key."""
    if not sys.platform.startswith("linux"):
        return SandboxInfo("none", f"no sandbox on {sys.platform}: tether confines processes on Linux only")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return SandboxInfo("none", f"bwrap is not installed: {INSTALL_HINT}")
    key = _cache_key(bwrap, run_as) if cache_dir is not None else None
    if key is not None and cache_dir is not None:
        cached = _read_cache(Path(cache_dir) / CACHE_FILE, key)
        if cached is not None:
            return cached
    info = _detect(bwrap, run_as)
    if key is not None and cache_dir is not None and info.available:
        _write_cache(Path(cache_dir) / CACHE_FILE, key, info)
    return info


def _detect(bwrap: str, run_as: RunAs | None = None) -> SandboxInfo:
    problem = _probe(bwrap, run_as)
    if problem is not None:
        # as a root device's run_as user the likeliest cause is that user (the problem says so): not the install
        hint = INSTALL_HINT if run_as is None else f"give run_as a user who can run it first; else {INSTALL_HINT}"
        return SandboxInfo("none", f"bwrap cannot confine commands here ({problem}): {hint}", bwrap)
    from tether.sandbox.confine.landlock import abi_version

    abi = abi_version()
    if abi:
        return SandboxInfo("bwrap+landlock+overlay", f"bubblewrap with user, mount, pid namespaces, Landlock ABI {abi} "
                           "under them; writes captured in an overlay", bwrap, abi)
    return SandboxInfo("bwrap+overlay", "bubblewrap with user, mount, pid namespaces (no Landlock in this kernel); "
                       "writes captured in an overlay", bwrap)


def _stat(path: str) -> list[Any]:
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino]


def _cache_key(bwrap: str, run_as: RunAs | None = None) -> dict[str, Any] | None:
    """Everything the probe's answer depends on; None (no caching) when any of it cannot be read."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        here = os.path.dirname(os.path.abspath(__file__))
        knobs = {}
        for knob in _USERNS_KNOBS:
            with contextlib.suppress(FileNotFoundError):
                knobs[knob] = Path(knob).read_text().strip()
        return {"boot": boot, "kernel": os.uname().release, "uid": os.getuid(),
                "run_as": None if run_as is None else [run_as.uid, run_as.gid], "bwrap": _stat(bwrap),
                "python": [sys.executable, sys.version],
                "probe": [_stat(os.path.join(here, name)) for name in ("detect.py", "confine/bwrap.py",
                                                                  "confine/warden.py", "confine/command.py",
                                                                  "confine/mounts.py", "confine/run_as.py")],
                "knobs": knobs}
    except OSError:
        return None


def _read_cache(path: Path, key: dict[str, Any]) -> SandboxInfo | None:
    try:
        with path.open("rb") as fh:
            data = json.loads(fh.read(_CACHE_MAX_BYTES))
        if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps(key)):
            return None
        info = SandboxInfo(**data["info"])
    except (OSError, ValueError, TypeError, KeyError):
        return None  # missing, unreadable, from another version: probe again
    if not (info.available and isinstance(info.kind, str) and isinstance(info.detail, str)
            and isinstance(info.bwrap, str) and isinstance(info.landlock, int)):
        return None
    return info


def _write_cache(path: Path, key: dict[str, Any], info: SandboxInfo) -> None:
    """Written whole or not at all (a temporary file renamed); a state directory that cannot be written
    only means the next start probes again."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": key, "info": asdict(info)}, fh)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
