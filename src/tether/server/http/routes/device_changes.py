"""Managing the fleet's devices over REST (docs/fleet.md): `DELETE /api/v1/devices/{name}` forgets a
device; `PATCH /api/v1/devices/{name}` renames it or sets its tags; `GET /api/v1/devices/{name}/key` says
which key it is enrolled with (for `tether devices NAME`).

Removal acts on the whole fleet's keys (a device's tokens and enrolled key), so it needs an `admin`
token that reaches every device (`require_fleet`), as the token routes do; an agent's token never
holds `admin`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from tether.errors import ServerError
from tether.protocol.identity import fingerprint
from tether.server.aip.hub import DeviceHub
from tether.server.http.api import ERROR_RESPONSES, in_scope, require, require_fleet
from tether.server.store import Store
from tether.server.store.tokens import SCOPE_TAG, TokenInfo

device_router = APIRouter(prefix="/api/v1/devices", responses=ERROR_RESPONSES, tags=["devices"])

REMOVE_TOOL = "device.remove"  # the audit rows' tool_name for a removal, a rename, a change of tags
RENAME_TOOL = "device.rename"
TAGS_TOOL = "device.tags"
DEVICE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$"  # as pairing and `tether token create` take it
DEVICE_TAG = SCOPE_TAG.pattern  # a tag a tag-scoped token can name


class DeviceChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, pattern=DEVICE_NAME, description="the device's new name")
    tags: list[Annotated[str, Field(pattern=DEVICE_TAG)]] | None = Field(
        None, max_length=32, description="the device's tags from now on, in place of those it reports")


class DeviceChangeRefused(ServerError):
    """A change the server will not make; `status` is its HTTP status (404, 409)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def remove_device(hub: DeviceHub, name: str, by: str) -> dict[str, Any]:
    """Forget device `name`: revoke its device tokens and its enrolled key (it cannot come back without
    pairing or a new token), disconnect it if connected (its running batches fail), and drop it from the
    registry and the `devices` table. Its audit rows stay, and one more records the removal and `by`.

    Returns `{removed, was, revoked_tokens}` (`was`: the status it had); `LookupError` when the server
    knows no device of that name (no record, row, key or active device token). The statements run without
    holding up the event loop (`Store.call`)."""
    store = hub.store
    record = hub.registry.get(name)
    known = record is not None or await store.call(_stored, store, name)
    if not known:
        raise LookupError(f"no device named '{name}'")
    was = record.status if record is not None else "offline"
    revoked = await store.call(store.tokens.revoke_device, name)
    await hub.enforce_revocations()  # a connected device is dropped now (no grace): its batches fail
    await store.call(store.device_keys.forget, name)
    # after the drop, which stores the device's last_seen once more (`Store.soon`: in order after it)
    await store.call(store.devices.forget, name, in_order=True)
    hub.registry.forget(name)
    hub.registry.notify()
    hub.fleet_changed(name)
    store.audit.record(by, name, None, REMOVE_TOOL, {"was": was, "revoked_tokens": revoked}, "success", None)
    return {"removed": name, "was": was, "revoked_tokens": revoked}


@device_router.delete("/{name}")
async def delete_device(name: str, request: Request,
                        who: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> dict[str, Any]:
    """Remove the device (see `remove_device`): 404 for a name the server does not know."""
    try:
        return await remove_device(request.app.state.hub, name, f"api:{who.name}")
    except LookupError as exc:
        raise HTTPException(404, str(exc)) from None


@device_router.get("/{name}/key")
async def device_key(name: str, request: Request,
                     who: Annotated[TokenInfo, Depends(require("read"))]) -> dict[str, Any]:
    """The key enrolled for the device: `{name, fingerprint (SHA-256 hex of the public key), enrolled_at,
    enrolled_by}`; the key fields are null when none is enrolled yet. 404 for a device the token does not
    reach or the server does not know."""
    registry, store = request.app.state.registry, request.app.state.store
    in_scope(registry, who, name)
    enrolled = await store.call(store.device_keys.get, name)
    if enrolled is None and registry.get(name) is None and not await store.call(store.devices.known, name):
        raise HTTPException(404, f"no device named '{name}'")
    if enrolled is None:
        return {"name": name, "fingerprint": None, "enrolled_at": None, "enrolled_by": None}
    return {"name": name, "fingerprint": fingerprint(enrolled.public_key), "enrolled_at": enrolled.enrolled_at,
            "enrolled_by": enrolled.enrolled_by}


async def _exists(hub: DeviceHub, name: str) -> bool:
    return hub.registry.get(name) is not None or await hub.store.call(_stored, hub.store, name)


def _stored(store: Store, name: str) -> bool:
    """Whether the store knows device `name` (a row, an enrolled key or an active device token)."""
    return store.devices.known(name) or store.device_keys.get(name) is not None or store.tokens.has_active_device(name)


async def set_tags(hub: DeviceHub, name: str, tags: list[str], by: str) -> list[str]:
    """Make `tags` (deduplicated, order kept) device `name`'s tags, in place of the ones it reports, in the
    registry and the store (kept at every registration); audited. Returns the tags. The statements run
    without holding up the event loop (`Store.call`)."""
    if not await _exists(hub, name):
        raise DeviceChangeRefused(404, f"no device named '{name}'")
    kept = list(dict.fromkeys(tags))
    record = hub.registry.get(name)
    before = list(record.tags) if record is not None else []
    await hub.store.call(hub.store.devices.set_tags, name, kept, time.time())
    hub.registry.override_tags(name, kept)
    hub.registry.notify()
    hub.fleet_changed(name)
    hub.store.audit.record(by, name, None, TAGS_TOOL, {"before": before, "after": kept}, "success", None)
    return kept


async def check_rename(hub: DeviceHub, old: str, new: str) -> None:
    """`DeviceChangeRefused` when `rename_device(old, new)` would be refused (see there), else nothing."""
    if not await _exists(hub, old):
        raise DeviceChangeRefused(404, f"no device named '{old}'")
    if new == old:
        return
    if await _exists(hub, new):
        raise DeviceChangeRefused(409, f"device '{new}' exists already: remove it first (tether devices rm {new})")
    record = hub.registry.get(old)
    if hub.holds(old) or (record is not None and record.connected):  # here, or (a cluster) on another node
        raise DeviceChangeRefused(409, f"device '{old}' is connected: stop it, rename it, then start it with the "
                                       f"name '{new}' (its config's device.name, or --name)")
    tokens = await hub.store.call(hub.store.tokens.all)
    scoped = [t.name for t in tokens if t.active and t.kind == "api" and old in t.devices]
    if scoped:
        raise DeviceChangeRefused(409, f"API token(s) {', '.join(sorted(set(scoped)))} are scoped to device "
                                       f"'{old}' by name: revoke them (or scope them otherwise) before renaming")


async def rename_device(hub: DeviceHub, old: str, new: str, by: str) -> None:
    """Rename device `old` to `new`: its device tokens, enrolled key, stored row (with its tags) and registry
    record follow; its audit rows keep the old name, and one more records the rename.

    Refused (`DeviceChangeRefused`) with 404 for an unknown `old`; 409 when `new` is a device already, when
    `old` is connected (or within its grace period: its batches wait under that name), or when an active
    API token names `old` in its device scope (a glob or tag scope is not refused; it is evaluated on the
    new name from then on). The device itself must use the new name when it connects again (its config's
    `device.name`, `--name`), since a registration claiming another name than its token's is refused. The
    statements run without holding up the event loop (`Store.call`)."""
    await check_rename(hub, old, new)
    if new == old:
        return
    record = hub.registry.get(old)
    override = hub.registry.tag_override(old)
    last_seen = record.last_seen if record is not None else None
    platform = record.platform if record is not None else None
    tags = list(override if override is not None else record.tags if record is not None else ())
    await hub.store.call(hub.store.device_keys.rename, old, new)
    had_row = await hub.store.call(hub.store.devices.rename, old, new)
    hub.registry.forget(old)
    if override is not None:
        hub.registry.override_tags(new, override)
    if record is not None or had_row:
        hub.registry.known(new, last_seen, platform, tags, stored=had_row)
    hub.registry.notify()
    hub.fleet_changed(old)
    hub.fleet_changed(new)
    hub.store.audit.record(by, old, None, RENAME_TOOL, {"from": old, "to": new}, "success", None)
    hub.store.audit.record(by, new, None, RENAME_TOOL, {"from": old, "to": new}, "success", None)


@device_router.patch("/{name}")
async def change_device(name: str, body: DeviceChange, request: Request,
                        who: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> dict[str, Any]:
    """Set the device's tags and/or rename it (`set_tags`, `rename_device`; tags first, under the old name).
    Answers `{name, tags}` as the device now is."""
    hub: DeviceHub = request.app.state.hub
    by = f"api:{who.name}"
    try:
        if not await _exists(hub, name):
            raise DeviceChangeRefused(404, f"no device named '{name}'")
        if body.name is not None:  # refused before anything changes
            await check_rename(hub, name, body.name)
        if body.tags is not None:
            await set_tags(hub, name, body.tags, by)
        if body.name is not None:
            await rename_device(hub, name, body.name, by)
    except DeviceChangeRefused as exc:
        raise HTTPException(exc.status, str(exc)) from None
    now = body.name or name
    record = hub.registry.get(now)
    return {"name": now, "tags": list(record.tags) if record is not None else body.tags or []}
