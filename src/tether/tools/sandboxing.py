"""The device's sandbox from its policy: which roots are captured, what is hidden, where layers live.

Kept apart from `tether.sandbox` (which knows nothing of policies) so the mechanism stays a small
library and the rules that feed it stay with the other rules.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
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


def layers_dir(roots: Iterable[str], run_as: RunAs | None = None) -> str | None:
    """A private directory for overlay layers, outside every root (an overlay may not contain its own layer).

    $TETHER_SANDBOX_LAYERS, else /var/tmp, else /dev/shm (memory), whichever lies outside the roots.
    With `run_as` (a root device's sandbox user) it is that user's, mode 0700: its warden mounts there.
    """
    real_roots = [os.path.realpath(os.path.expanduser(r)) for r in roots]
    candidates = [os.environ.get("TETHER_SANDBOX_LAYERS", ""), "/var/tmp", "/dev/shm", tempfile.gettempdir()]
    for base in filter(None, candidates):
        real = os.path.realpath(base)
        name = f"tether-layers-{os.getuid()}" + (f"-as-{run_as.uid}" if run_as is not None else "")
        path = real if base == candidates[0] else os.path.join(real, name)
        place = os.path.realpath(path)
        if under(place, real_roots) or any(under(r, [place]) for r in real_roots) or not os.access(real, os.W_OK):
            continue
        try:
            Path(path).mkdir(mode=0o700, exist_ok=True)
            owner = os.getuid() if run_as is None else run_as.uid
            if os.lstat(path).st_uid not in (os.getuid(), owner) or os.path.islink(path):
                continue
            if run_as is not None and os.lstat(path).st_uid != run_as.uid:
                if os.listdir(path):  # never hand over a directory that holds someone's files already
                    continue
                os.chown(path, run_as.uid, run_as.gid, follow_symlinks=False)
            os.chmod(path, 0o700)
        except OSError:
            continue
        return path
    return None


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
