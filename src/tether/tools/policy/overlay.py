"""The part of a device's policy its server sets (`tether policy set/allow/deny/approve`), as pure functions.

A device's effective policy is its own (the defaults and its policy file) with the server's overlay on
top: top-level settings replace the device's, `commands` entries replace or remove one program's rule.
Settings that decide how processes are confined are the device's alone — a server that could turn off
its devices' sandbox would be the one place to attack — and so is whether the server may change
anything at all (`policy_remote`). `network` is the server's to narrow, never to widen (`narrow_network`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tether import yaml12
from tether.sandbox.egress.rules import meet
from tether.tools.policy.model import NetworkRules, Policy, default_policy, policy_from_mapping

DEVICE_ONLY: frozenset[str] = frozenset({
    "policy_remote", "sandbox", "require_sandbox", "hide_paths", "live_write_roots",
    "protected_paths", "unprotect_paths", "allow_sockets", "limits", "private_tmp",
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
    unknown = sorted(set(overlay) - set(Policy.model_fields), key=str)
    if unknown:
        raise ValueError(f"unknown policy setting(s): {', '.join(map(yaml12.shown_key, unknown))}")
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
    if "network" in overlay:
        data["network"] = narrow_network(base.network, overlay["network"])
    return policy_from_mapping({**data, "commands": commands, "replace_commands": True}, where="remote policy")


def _describe(network: bool | NetworkRules) -> str:
    if isinstance(network, NetworkRules):
        return "host list"
    return "network: on" if network else "network: off"


def narrow_network(device: bool | NetworkRules, pushed: Any) -> bool | NetworkRules:
    """The device's `network` narrowed by the server's: never more than the device's own allows.

    The server's `on` stands only over a device that is on itself, and is refused over an `off` or a
    host list. Otherwise off (the device's or the server's) is off. Over a device that is on, a server's list is
    the list. Over a device's list: the allow entries both lists cover (`egress.rules.meet`), the deny
    entries of both, `ask: on-miss` only where the device asks too; the device's own rules stay as
    `within`, which every connection must also pass. ValueError, saying why, for a widening or a
    malformed value.
    """
    server = Policy.model_validate({"network": pushed}).network
    if isinstance(server, NetworkRules) and server.within is not None:
        raise ValueError("network.within is the device's own list; a server sets allow, deny and ask")
    if server is True:
        if device is True:
            return True
        raise ValueError(f"network: on would widen this device's own {_describe(device)}; a server can only "
                         "narrow the network (off, or a host list)")
    if device is False or server is False:
        return False
    assert isinstance(server, NetworkRules)
    if device is True:
        return server
    if server.ask == "on-miss" and device.ask != "on-miss":
        raise ValueError("network.ask: on-miss would let a person open hosts this device's own policy refuses "
                         "(its network.ask is off)")
    deny = list(dict.fromkeys([*device.deny, *server.deny]))
    return NetworkRules(allow=meet(server.allow, device.allow), deny=deny, ask=server.ask, within=device)


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
