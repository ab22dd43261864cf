"""`ScreenNodes`: the live view across the nodes of a cluster (docs/desktop.md, "Live view").

A person may open a device's live view on any node. Screenshots already cross on their own (a batch for a
device another node holds runs there). What this adds:
- the hold lives on the node holding the device's connection, since every batch for the device, asked on any
  node, passes that node's router (`DesktopHolds.refusal`): a view on another node takes, renews and
  releases it there over the cluster's requests (`desktop.hold` on `RemoteDevices.call`), with a `ttl`, so a
  hold whose view's node died runs out on its own; the person's own batches carry the hold's key there;
- the desktop actions and hold changes that node sees reach this node's views: a view asks the holding node
  (`watch`, renewed while it runs) to relay that device's desktop events here (`desktop` relay topic).

On a single server (or for a device held here) every call acts on this node's `DesktopHolds` directly.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException

from tether.server.aip.desktop_holds import DesktopHeld

if TYPE_CHECKING:
    from collections.abc import Callable

    from tether.server.aip.hub import DeviceHub

log = logging.getLogger("tether.server.web")

CALL_TIMEOUT_S = 10.0  # a hold's take, keep or release on the node holding the device
WATCH_S = 20.0  # how long the holding node relays a device's desktop events after a view's `watch`
RELAY_TOPIC = "desktop"
HOLD_KIND = "desktop.hold"


@dataclass
class ScreenNodes:
    """This node's live views' reach into the cluster (`hub.remote`, None on a single server). `start()` once
    the cluster node runs (it answers the other nodes' `desktop.hold` requests and feeds relayed events to
    this node's watchers); the closer it returns undoes that."""

    hub: DeviceHub
    # on the node holding a device: device -> {node asking for its events: until (monotonic)}
    _relays: dict[str, dict[str, float]] = field(default_factory=dict)
    _unwatch: dict[str, Callable[[], None]] = field(default_factory=dict)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def start(self) -> Callable[[], None]:
        """Answer other nodes' hold requests and take their relayed events (a no-op on a single server)."""
        remote = self.hub.remote
        if remote is None:
            return lambda: None
        remote.handle(HOLD_KIND, self._serve)
        unrelay = remote.on_relay(RELAY_TOPIC, self._relayed)

        def close() -> None:
            unrelay()
            for remove in self._unwatch.values():
                remove()
            self._unwatch.clear()
            for task in self._tasks:
                task.cancel()

        return close

    # -- a view's side ------------------------------------------------------------------------------

    async def where(self, device: str) -> str | None:
        """The other node holding `device`'s connection, or None when it is this one (or none: offline, or a
        single server). 503 when the cluster's backplane cannot say."""
        remote = self.hub.remote
        if remote is None or self.hub.holds(device):
            return None
        try:
            node = await remote.holder(device)
        except Exception as exc:
            raise HTTPException(503, f"cannot tell which node holds device {device}: {exc}") from None
        return None if node is None or node == remote.node else node

    async def located(self, device: str) -> str | None:
        """The node holding `device`'s connection now: its name, "" for this one, None for none (offline).
        503 when the cluster's backplane cannot say."""
        if self.hub.holds(device):
            return ""
        node = await self.where(device)
        return node if node is not None else (None if self.hub.remote is not None else "")

    async def take(self, device: str, holder: str, ttl: float) -> tuple[str, float, str]:
        """Hold `device`'s desktop for `holder` where the device is: (key, since, the node holding it, "" for
        this one). `DesktopHeld` when another person holds it; 503 when its node does not answer."""
        node = await self.where(device)
        if node is None:
            hold = self.hub.desktop.take(device, holder, ttl=ttl)
            return hold.key, hold.since, ""
        reply = await self._ask(node, device, {"op": "take", "holder": holder, "ttl": ttl})
        if "held_by" in reply:
            raise DesktopHeld(device, str(reply["held_by"]))
        return str(reply["key"]), float(reply["since"]), node

    async def keep_at(self, node: str, device: str, key: str) -> bool:
        """Renew the hold `key` on `node` ("" for this one, as `take` said); False when it is not held with
        that key there (it ran out, or was replaced). 503 when that node does not answer."""
        if not node:
            return self.hub.desktop.keep(device, key)
        return bool((await self._ask(node, device, {"op": "keep", "key": key})).get("held"))

    async def release_at(self, node: str, device: str, key: str) -> bool:
        """End the hold `key` on `node` ("" for this one); False when there was none with that key there.
        503 when that node does not answer."""
        if not node:
            return self.hub.desktop.release(device, key)
        return bool((await self._ask(node, device, {"op": "release", "key": key})).get("released"))

    def release_soon(self, node: str, device: str, key: str, then: Callable[[bool], None]) -> None:
        """`release_at` off the caller's path (a stream ending under cancellation; a node that may be dead);
        `then(released)` after."""
        async def run() -> None:
            try:
                released = await self.release_at(node, device, key)
            except Exception as exc:  # the hold runs out there by its ttl
                log.warning("could not hand back device %s's desktop at once (%s): its hold runs out instead",
                            device, getattr(exc, "detail", exc))
                return
            then(released)

        task = asyncio.create_task(run(), name=f"live-view-release-{device}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def watch(self, device: str) -> str | None:
        """Have the node holding `device` relay its desktop events here for `WATCH_S` (nothing to do when it
        is this node); the holder of its desktop now, or None."""
        node = await self.where(device)
        if node is None:
            hold = self.hub.desktop.current(device)
            return hold.holder if hold is not None else None
        remote = self.hub.remote
        assert remote is not None
        reply = await self._ask(node, device, {"op": "watch", "node": remote.node})
        holder = reply.get("holder")
        return str(holder) if holder else None

    async def _ask(self, node: str, device: str, body: dict[str, Any]) -> dict[str, Any]:
        remote = self.hub.remote
        if remote is None:
            raise HTTPException(503, "this server left the cluster")
        try:
            return await remote.call(node, HOLD_KIND, {**body, "device": device}, CALL_TIMEOUT_S)
        except Exception as exc:
            raise HTTPException(503, f"node {node} holding device {device} did not answer: {exc}") from None

    def _relayed(self, data: dict[str, Any]) -> None:
        remote = self.hub.remote
        event = data.get("event")
        if remote is None or remote.node not in (data.get("to") or ()) or not isinstance(event, dict):
            return
        self.hub.desktop.tell(str(data.get("device", "")), event)

    # -- the holding node's side --------------------------------------------------------------------

    async def _serve(self, body: dict[str, Any]) -> dict[str, Any]:
        """Another node's view acting on a hold of a device held here (see the module docstring)."""
        desktop = self.hub.desktop
        device, op = str(body.get("device", "")), body.get("op")
        if op == "take":
            ttl = float(body.get("ttl") or 0) or None
            try:
                hold = desktop.take(device, str(body.get("holder") or "?")[:128], ttl=ttl)
            except DesktopHeld as exc:
                return {"held_by": exc.holder}
            return {"key": hold.key, "since": hold.since}
        if op == "keep":
            return {"held": desktop.keep(device, str(body.get("key", "")))}
        if op == "release":
            return {"released": desktop.release(device, str(body.get("key", "")))}
        if op == "watch":
            self._relay_to(device, str(body.get("node", "")))
            now = desktop.current(device)
            return {"holder": now.holder if now is not None else None}
        raise ValueError(f"unknown desktop.hold operation {op!r}")

    def _relay_to(self, device: str, node: str) -> None:
        loop = asyncio.get_running_loop()
        self._relays.setdefault(device, {})[node] = loop.time() + WATCH_S
        if device in self._unwatch:
            return

        def told(event: dict[str, Any]) -> None:
            now = loop.time()
            nodes = {n: until for n, until in self._relays.get(device, {}).items() if until > now}
            remote = self.hub.remote
            if not nodes or remote is None:  # no view on another node asked lately: stop relaying
                self._relays.pop(device, None)
                remove = self._unwatch.pop(device, None)
                if remove is not None:
                    remove()
                return
            self._relays[device] = nodes
            remote.relay(RELAY_TOPIC, {"device": device, "to": sorted(nodes), "event": event})

        self._unwatch[device] = self.hub.desktop.watch(device, told)
