"""What a sandbox lets a process see and change: a pure description, built from the device's policy."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from tether.errors import SandboxError
from tether.sandbox.confine.limits import Limits
from tether.sandbox.confine.run_as import RunAs

ANY_SOCKET = "*"  # allow_sockets entry: every unix socket, by path or abstract name (the IPC wall off)
OWN_SOCKETS = "sandbox"  # allow_sockets entry: unix sockets the sandbox binds itself; none of the machine's
SOCKET_WORDS = (ANY_SOCKET, OWN_SOCKETS)

class SandboxUnavailable(SandboxError, RuntimeError):
    """No sandbox can be made here (no bwrap, no user namespaces...); the message says why and what to do."""


def _real(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def under(path: str, roots: Iterable[str]) -> bool:
    """Whether `path` is one of `roots` or lies inside one (plain strings: both already real paths)."""
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _outermost(paths: list[str]) -> tuple[str, ...]:
    """Real paths with the ones inside another dropped: an overlay on `~` already covers `~/src`."""
    kept: list[str] = []
    for p in sorted({_real(p) for p in paths}, key=len):
        if not under(p, kept):
            kept.append(p)
    return tuple(kept)


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """The confinement of one device's processes.

    `write_roots` are writable through a per-command overlay (changes captured); `live_write_roots`
    are bound writable directly (changes happen at once and are not undoable); everything else is
    read-only. `hidden` paths (the device's own state, token and config, key folders) are replaced
    by an empty directory or an empty file. `network=False` gives a private network namespace with
    only a loopback device. `allow_sockets` are the unix sockets outside the sandbox a process may
    connect to (none: no unix socket can be made at all; `OWN_SOCKETS`: only those it binds itself;
    `ANY_SOCKET`: all); `limits` caps each command's resources.
    """

    write_roots: tuple[str, ...] = ()
    live_write_roots: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    network: bool = True
    layers_dir: str = ""
    # places whose content another program later runs (real paths): never written by a live process
    # (see tether.sandbox.confine.guard); a captured command's changes there are held at apply time instead
    protected: tuple[str, ...] = ()
    # protected names that match at any depth (`.git/config`): bound read-only where they exist near a
    # live root's top (tether.sandbox.confine.guard)
    protected_names: tuple[str, ...] = ()
    allow_sockets: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    # the unprivileged user a root device starts bwrap as (docs/security/root.md); None: as the device itself
    run_as: RunAs | None = None
    # each session's commands get their own /tmp where the temp dir is a captured root (sandbox.private_tmp)
    private_tmp: bool = False
    # the captured write roots as the policy names them, nested ones included (real paths): those below the
    # temp dir stay the machine's with a private /tmp, seen through its overlay, captured (sandbox.private_tmp)
    tmp_roots: tuple[str, ...] = ()

    @classmethod
    def build(cls, *, write_roots: list[str], live_write_roots: list[str] = (), hidden: list[str] = (),  # type: ignore[assignment]
              network: bool = True, layers_dir: str = "", protected: Iterable[str] = (),
              protected_names: Iterable[str] = (), allow_sockets: list[str] = (),  # type: ignore[assignment]
              limits: Limits | None = None, run_as: RunAs | None = None, private_tmp: bool = False,
              tmp_roots: Iterable[str] = ()) -> SandboxSpec:
        live = _outermost(list(live_write_roots))
        return cls(write_roots=_outermost(list(write_roots)), live_write_roots=live,
                   hidden=tuple(sorted({_real(h) for h in hidden})), network=network, layers_dir=layers_dir,
                   protected=tuple(sorted({_real(p) for p in protected})),
                   protected_names=tuple(sorted(set(protected_names))),
                   allow_sockets=tuple(sorted({s if s in SOCKET_WORDS else _real(s) for s in allow_sockets})),
                   limits=limits or Limits(), run_as=run_as, private_tmp=private_tmp,
                   tmp_roots=tuple(sorted({_real(r) for r in tmp_roots})))
