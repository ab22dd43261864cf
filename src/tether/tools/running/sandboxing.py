"""The device's sandbox from its policy: which roots are captured, what is hidden, where layers live.

Kept apart from `tether.sandbox` (which knows nothing of policies) so the mechanism stays a small
library and the rules that feed it stay with the other rules.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from tether.sandbox import SandboxInfo, SandboxSpec, detect
from tether.sandbox.confine.limits import Limits
from tether.sandbox.confine.run_as import RunAs
from tether.sandbox.confine.spec import under
from tether.sandbox.egress.rules import EgressRules
from tether.tools.policy.model import NetworkRules, Policy
from tether.tools.policy.path_rules import anchored, anchored_places, protected_patterns

if TYPE_CHECKING:  # the runner (and its egress proxy) only where a sandbox is made: `make_sandbox`
    from tether.sandbox.egress.proxy import AskFn, EgressRecord
    from tether.sandbox.runner import Sandbox

logger = logging.getLogger(__name__)


LAYERS_ENV = "TETHER_SANDBOX_LAYERS"


def layers_dir(roots: Iterable[str], run_as: RunAs | None = None) -> str | None:
    """A private directory for overlay layers, outside every root (an overlay may not contain its own layer).

    $TETHER_SANDBOX_LAYERS (created, mode 0700, when missing and the path to it is safe: see `_made_private`), else
    /var/tmp, else /dev/shm (memory), whichever lies outside the roots. With `run_as` (a root device's sandbox
    user) it is that user's, mode 0700: its warden mounts there. A $TETHER_SANDBOX_LAYERS that cannot be used is
    never passed over in silence: one warning names the variable, why, and the directory used instead.
    Result: the directory, or None when no candidate can be used.
    """
    real_roots = [os.path.realpath(os.path.expanduser(r)) for r in roots]
    chosen = os.environ.get(LAYERS_ENV, "")
    if chosen:
        path, problem = _chosen_layers(chosen, real_roots, run_as)
        if path is not None:
            return path
    for base in filter(None, ["/var/tmp", "/dev/shm", tempfile.gettempdir()]):
        real = os.path.realpath(base)
        name = f"tether-layers-{os.getuid()}" + (f"-as-{run_as.uid}" if run_as is not None else "")
        path = os.path.join(real, name)
        if _outside_roots(os.path.realpath(path), real_roots) and os.access(real, os.W_OK) \
                and _made_private(path, run_as) is None:
            break
    else:
        path = None
    if chosen:
        logger.warning("%s=%s is not used: %s; the sandbox's layers go to %s instead", LAYERS_ENV, chosen, problem,
                       path or "no directory (no sandbox)")
    return path


def _chosen_layers(chosen: str, real_roots: list[str], run_as: RunAs | None) -> tuple[str | None, str]:
    """$TETHER_SANDBOX_LAYERS as a layers directory: (its path, "") or (None, why not).

    The path is taken as written (made absolute): no component may be a symlink, and every directory above it
    must be one that only root or this user can change (see `_made_private`); the directory itself is made
    there (mode 0700) when missing, never its parents."""
    path = os.path.normpath(os.path.abspath(os.path.expanduser(chosen)))
    if path == "/":
        return None, "it is / itself"
    clash = next((r for r in real_roots if under(path, [r]) or under(r, [path])), None)
    if clash is not None:
        return None, f"it lies inside the write root {clash}, or holds it (an overlay may not contain its own layers)"
    problem = _made_private(path, run_as)
    return (None, problem) if problem else (path, "")


def _outside_roots(place: str, real_roots: list[str]) -> bool:
    return not under(place, real_roots) and not any(under(r, [place]) for r in real_roots)


# O_PATH (Linux) passes a directory that may be searched but not listed; elsewhere it is read
_WALK = (getattr(os, "O_PATH", 0) or os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _made_private(path: str, run_as: RunAs | None) -> str | None:
    """Make `path` (absolute, normalised; mode 0700) or take it as it is if it is ours: None, or why it cannot be
    the layers directory, in words that name the component at fault.

    Walked from `/` one component at a time through held descriptors (`O_NOFOLLOW|O_DIRECTORY` opens relative to
    the directory checked a step before), so each directory checked is the one the next step opens. Refused: a
    symlink anywhere on the path; a directory above the last one owned by anyone but root or this user, or
    writable by its group or others without the sticky bit (whoever can write it could rename what is below
    and put their own in its place; in a sticky one, as /tmp, nobody can move another's entry, and each entry
    on the path is root's or ours); a last directory that is not this user's (or `run_as`'s), or, for `run_as`,
    one that holds files already. Every directory on the accepted path is then beyond any other user's reach,
    so the path keeps naming the directory checked for as long as it is used."""
    owner = os.getuid() if run_as is None else run_as.uid
    names = [n for n in path.split("/") if n]
    fd = os.open("/", _WALK)
    try:
        here = "/"
        for index, name in enumerate(names):
            problem = _unsafe_above(fd, here)
            if problem:
                return problem
            last = index == len(names) - 1
            if last:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)  # never follows a symlink planted in its place: that one exists
            here = os.path.join(here, name)
            try:
                step = os.open(name, _OPEN if last else _WALK, dir_fd=fd)
            except OSError as exc:
                return _why_not_opened(fd, name, here, exc)
            os.close(fd)
            fd = step
        found = os.fstat(fd)
        if found.st_uid not in (os.getuid(), owner):
            return f"{path} belongs to another user (uid {found.st_uid})"
        if run_as is not None and found.st_uid != run_as.uid:
            if os.listdir(fd):  # never hand over a directory that holds someone's files already
                return f"{path} holds files already and is not {run_as.name}'s"
            os.fchown(fd, run_as.uid, run_as.gid)
        os.fchmod(fd, 0o700)
        named = os.stat(path, follow_symlinks=False)  # only root or we could have changed it: said, not used
        if (named.st_dev, named.st_ino) != (found.st_dev, found.st_ino):
            return f"{path} was replaced while it was checked"
    except OSError as exc:
        return f"{path} cannot be made private ({exc.strerror})"
    finally:
        os.close(fd)
    return None


def _unsafe_above(fd: int, here: str) -> str | None:
    """Why the directory `fd` (named `here`) cannot hold the layers' path, or None: see `_made_private`."""
    st = os.fstat(fd)
    if st.st_uid not in (os.getuid(), 0):
        return f"{here} belongs to another user (uid {st.st_uid}), who could swap what is below it"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"{here} can be changed by another user (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}), "
                f"who could swap what is below it")
    return None


def _why_not_opened(fd: int, name: str, here: str, exc: OSError) -> str:
    """The failed step's reason in words: a symlink (which `O_NOFOLLOW|O_DIRECTORY` reports as not a directory),
    not a directory, or the error's own."""
    try:
        found = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return f"{here} cannot be used ({exc.strerror})"
    if stat.S_ISLNK(found.st_mode):
        return f"{here} is a symlink (give the directory's own path, with no link on it)"
    if not stat.S_ISDIR(found.st_mode):
        return f"{here} is not a directory"
    return f"{here} cannot be used ({exc.strerror})"


def sandbox_spec(policy: Policy, *, hidden: Iterable[str] = (), layers: str = "",
                 run_as: RunAs | None = None) -> SandboxSpec:
    live = list(policy.live_write_roots)
    live_real = [os.path.realpath(os.path.expanduser(p)) for p in live]
    captured = [r for r in policy.write_roots if os.path.realpath(os.path.expanduser(r)) not in live_real]
    if run_as is not None:  # a root device's sandbox user: a root it cannot even reach (under /root) stays out
        unreachable = [r for r in [*captured, *live] if not run_as.reaches(os.path.realpath(os.path.expanduser(r)))]
        if unreachable:
            logger.warning("write roots %s are out of reach of the sandbox's user %s (docs/security/root.md): "
                           "commands cannot write there", ", ".join(unreachable), run_as.name)
        captured = [r for r in captured if r not in unreachable]
        live = [r for r in live if r not in unreachable]
    kept = [r for r in captured if os.path.isdir(os.path.expanduser(r))]
    return SandboxSpec.build(write_roots=kept,
                             live_write_roots=[p for p in live if os.path.isdir(os.path.expanduser(p))],
                             hidden=[*policy.hide_paths, *hidden], network=policy.network is True,
                             layers_dir=layers, protected=live_protected(policy),
                             protected_names=floating_protected(policy), allow_sockets=list(policy.allow_sockets),
                             # from_request keeps the warden's keys: layer_files/layer_bytes are the capture's
                             limits=Limits.from_request(policy.limits.model_dump()), run_as=run_as,
                             private_tmp=policy.private_tmp, tmp_roots=kept)


def floating_protected(policy: Policy) -> list[str]:
    """Protected patterns that match at any depth and hold no glob (`.git/config`, `.mcp.json`): a live
    process finds the existing ones near its roots' top read-only."""
    return [p for p in protected_patterns(policy)
            if not anchored(p) and not any(c in p for c in "*?[") and not p.startswith("/")]


def live_protected(policy: Policy) -> list[str]:
    """The protected paths a live process is kept from writing: each anchored pattern's glob-free
    leading part (`~/.config/autostart`; `~/.cargo/config*` guards `~/.cargo`). A pattern that
    matches at any depth (`.git/hooks`, `*.pth`) has no place to bind; see docs/security/protected-paths.md."""
    return [place for _, place in anchored_places(policy)]


def egress_rules(policy: Policy) -> EgressRules | None:
    """The egress proxy's rules when the policy lists hosts (`network: {allow: ...}`), else None."""
    network = policy.network
    return _rules(network) if isinstance(network, NetworkRules) else None


def _rules(network: NetworkRules) -> EgressRules:
    within = None if network.within is None else _rules(network.within)
    return EgressRules.build(allow=network.allow, deny=network.deny, ask=network.ask, within=within)


def follow_network(sandbox: Sandbox | None, policy: Policy) -> None:
    """Make a running sandbox follow the policy's `network` (after a server's change): see `Sandbox.renetwork`."""
    if sandbox is not None:
        sandbox.renetwork(policy.network is True, egress_rules(policy))


def make_sandbox(policy: Policy, *, hidden: Iterable[str] = (), info: SandboxInfo | None = None,
                 ask: AskFn | None = None, audit: Callable[[EgressRecord, str], None] | None = None,
                 run_as: RunAs | None = None, state_dir: str | os.PathLike[str] | None = None) -> Sandbox | None:
    """The device's sandbox, or None (with the reason logged) where none can be made here.

    `run_as`: the unprivileged user a root device starts its sandboxes as (docs/security/root.md); `info`
    must then be a probe made as that user. `state_dir`: where the sandbox keeps what must outlive a
    restart (`tether.sandbox.kept`: a person's `always` grants, the sessions' totals).

    A policy that lists hosts gets the egress proxy: `ask` answers `ask: on-miss` (without it an
    unlisted host is refused), `audit` sees every connection (see `Sandbox`)."""
    info = info or detect(run_as=run_as)
    if not info.available:
        logger.warning("no sandbox: %s", info.detail)
        return None
    layers = layers_dir(policy.write_roots, run_as)
    if layers is None:
        logger.warning("no sandbox: no writable directory outside the write roots for its layers "
                       "(set TETHER_SANDBOX_LAYERS)")
        return None
    from tether.sandbox.runner import Sandbox

    return Sandbox(info, sandbox_spec(policy, hidden=hidden, layers=layers, run_as=run_as),
                   egress=egress_rules(policy), ask=ask, audit=audit, state_dir=state_dir)
