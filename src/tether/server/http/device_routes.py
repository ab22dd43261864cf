"""Managing the fleet's devices over REST (docs/fleet.md): `DELETE /api/v1/devices/{name}` forgets a
device; `GET /api/v1/devices/{name}/key` says which key it is enrolled with (for `tether devices NAME`).

Removal acts on the whole fleet's keys (a device's tokens and enrolled key), so it needs an `admin`
token that reaches every device (`require_fleet`), as the token routes do; an agent's token never
holds `admin`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request

from tether.protocol.identity import fingerprint
from tether.server.aip.hub import DeviceHub
from tether.server.http.api import ERROR_RESPONSES, in_scope, require, require_fleet
from tether.server.store.tokens import TokenInfo

device_router = APIRouter(prefix="/api/v1/devices", responses=ERROR_RESPONSES, tags=["devices"])

REMOVE_TOOL = "device.remove"  # the audit row's tool_name for a removal


def remove_device(hub: DeviceHub, name: str, by: str) -> dict[str, Any]:
    """Forget device `name`: revoke its device tokens and its enrolled key (it cannot come back without
    pairing or a new token), disconnect it if connected (its running batches fail), and drop it from the
    registry and the `devices` table. Its audit rows stay, and one more records the removal and `by`.

    Returns `{removed, was, revoked_tokens}` (`was`: the status it had); `LookupError` when the server
    knows no device of that name (no record, row, key or active device token)."""
    store = hub.store
    record = hub.registry.get(name)
    known = (record is not None or store.devices.known(name) or store.device_keys.get(name) is not None
             or store.tokens.has_active_device(name))
    if not known:
        raise LookupError(f"no device named '{name}'")
    was = record.status if record is not None else "offline"
    revoked = store.tokens.revoke_device(name)
    hub.enforce_revocations()  # a connected device is dropped now (no grace): its batches fail
    store.device_keys.forget(name)
    store.devices.forget(name)  # after the drop, which stores the device's last_seen once more
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
        return remove_device(request.app.state.hub, name, f"api:{who.name}")
    except LookupError as exc:
        raise HTTPException(404, str(exc)) from None


@device_router.get("/{name}/key")
async def device_key(name: str, request: Request,
                     who: Annotated[TokenInfo, Depends(require("read"))]) -> dict[str, Any]:
    """The key enrolled for the device: `{name, fingerprint (SHA-256 hex of the public key), enrolled_at,
    enrolled_by}`; the key fields are null when none is enrolled yet. 404 for a device the token does not
    reach or the server does not know."""
    hub: DeviceHub = request.app.state.hub
    in_scope(hub, who, name)
    enrolled = hub.store.device_keys.get(name)
    if enrolled is None and hub.registry.get(name) is None and not hub.store.devices.known(name):
        raise HTTPException(404, f"no device named '{name}'")
    if enrolled is None:
        return {"name": name, "fingerprint": None, "enrolled_at": None, "enrolled_by": None}
    return {"name": name, "fingerprint": fingerprint(enrolled.public_key), "enrolled_at": enrolled.enrolled_at,
            "enrolled_by": enrolled.enrolled_by}
