"""The part of a device's policy its server sets (`tether policy set/allow/deny/approve`), as pure functions.

A device's effective policy is its own (the defaults and its policy file) with the server's overlay on
top: top-level settings replace the device's, `commands` entries replace or remove one program's rule.
Settings that decide how processes are confined are the device's alone — a server that could turn off
its devices' sandbox would be the one place to attack — and so is whether the server may change
anything at all (`policy_remote`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tether.tools.policy import Policy, default_policy, policy_from_mapping

DEVICE_ONLY: frozenset[str] = frozenset({
    "policy_remote", "sandbox", "require_sandbox", "network", "hide_paths", "live_write_roots",
    "protected_paths", "unprotect_paths", "allow_sockets", "limits",
})
MAX_OVERLAY_PROGRAMS = 1000


def check_overlay(overlay: Mapping[str, Any]) -> dict[str, Any]:
    """A server's overlay made safe to store: a mapping whose keys are policy settings the server may set."""
    if not isinstance(overlay, Mapping):
        raise ValueError(f"a policy must be a mapping of settings, not {type(overlay).__name__}")
    if "replace_commands" in overlay:
        raise ValueError("'replace_commands' is not for a server's policy: remove programs with 'name: null'")
    refused = sorted(DEVICE_ONLY & set(overlay))
    if refused:
        raise ValueError(f"{', '.join(refused)} can only be set in the device's own policy file")
    unknown = sorted(set(overlay) - set(Policy.model_fields))
    if unknown:
        raise ValueError(f"unknown policy setting(s): {', '.join(unknown)}")
    commands = overlay.get("commands") or {}
    if not isinstance(commands, Mapping):
        raise ValueError("'commands' must map program names to rules (null removes one)")
    if len(commands) > MAX_OVERLAY_PROGRAMS:
        raise ValueError(f"at most {MAX_OVERLAY_PROGRAMS} programs in one policy")
    return {**overlay, "commands": dict(commands)} if "commands" in overlay else dict(overlay)


def effective(base: Policy, overlay: Mapping[str, Any]) -> Policy:
    """`base` with the overlay on top (ValueError if the result is not a valid policy)."""
    data = base.model_dump()
    commands = dict(data.pop("commands"))
    for name, rule in (overlay.get("commands") or {}).items():
        if rule is None:
            commands.pop(name, None)
        else:
            commands[name] = {} if rule is True else rule
    data.update({k: v for k, v in overlay.items() if k != "commands"})
    return policy_from_mapping({**data, "commands": commands, "replace_commands": True}, where="remote policy")


def merged(overlay: Mapping[str, Any], change: Mapping[str, Any]) -> dict[str, Any]:
    """The overlay after `change` (an overlay itself): settings replace, command entries merge."""
    out = {k: v for k, v in overlay.items() if k != "commands"}
    out.update({k: v for k, v in change.items() if k != "commands"})
    commands = {**(overlay.get("commands") or {}), **(change.get("commands") or {})}
    if commands:
        out["commands"] = commands
    return out


def sources(base: Policy, overlay: Mapping[str, Any]) -> dict[str, Any]:
    """Where each value of the effective policy comes from: `default`, `file` (the device's own) or
    `remote`; `commands` per program."""
    defaults = default_policy()
    out: dict[str, Any] = {}
    for key in Policy.model_fields:
        if key == "commands":
            continue
        if key in overlay:
            out[key] = "remote"
        else:
            out[key] = "default" if getattr(base, key) == getattr(defaults, key) else "file"
    remote = overlay.get("commands") or {}
    names = set(base.commands) | set(defaults.commands) | set(remote)
    commands: dict[str, str] = {}
    for name in sorted(names):
        if name in remote:
            commands[name] = "remote (removed)" if remote[name] is None else "remote"
        elif name not in base.commands:
            commands[name] = "file (removed)"
        else:
            commands[name] = "default" if defaults.commands.get(name) == base.commands[name] else "file"
    out["commands"] = commands
    return out
