"""A token's device scope applied to the fleet: which devices a scoped API token sees and reaches.

An API token may be limited to some devices (`tether token create --api NAME --device D --tag T`, and the
token `tether mcp config --device D` makes): `TokenInfo.devices` (names or globs) and `TokenInfo.tags`. A
device outside the scope does not exist for the token: it is left out of every listing, and a request
naming it is answered 404 with the same words as for a device that never registered, naming the scope.
An unscoped token (both lists empty, every token made before scopes existed) reaches every device.
See docs/security/scopes.md.
"""

from __future__ import annotations

from collections.abc import Callable

from tether.server.aip.fleet.record import DeviceRecord
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.store.tokens import TokenInfo


def reaches(token: TokenInfo, registry: DeviceRegistry, name: str) -> bool:
    """Whether `token` reaches the device `name`, judged on its name and the tags it registered with."""
    if not token.scoped:
        return True
    record = registry.get(name)
    return token.reaches(name, record.tags if record is not None else ())


def within(token: TokenInfo) -> Callable[[DeviceRecord], bool] | None:
    """The test a device selection applies for `token` (least-loaded choice, fan-out), or None when it
    reaches every device (no test, no cost)."""
    if not token.scoped:
        return None
    return lambda record: token.reaches(record.name, record.tags)


def unknown_device(token: TokenInfo, name: str) -> str:
    """The 404 text for a device the token does not reach: a scoped token is told the same for a device
    outside its scope and one that never registered, so the answer does not say which devices exist."""
    shown = name[:128]
    if not token.scoped:
        return f"no device named '{shown}'"
    return f"no device named '{shown}' in the scope of token '{token.name}' ({token.scope_text()})"


def beyond(token: TokenInfo) -> str:
    """A clause for errors of selections a scoped token made: what it could choose from."""
    return f" within the scope of token '{token.name}' ({token.scope_text()})" if token.scoped else ""


def reached_names(token: TokenInfo, registry: DeviceRegistry) -> list[str] | None:
    """The known devices `token` reaches, by name, or None when it reaches every device."""
    if not token.scoped:
        return None
    return [r.name for r in registry.list() if token.reaches(r.name, r.tags)]
