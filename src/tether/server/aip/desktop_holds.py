"""`DesktopHolds`: who holds a device's desktop (a person taking over in the live view), and who watches it.

While a person holds a device's desktop, every batch with a desktop action for that device is refused
before it is sent, saying who holds it, unless it carries that hold's key (`TokenRef.hold`, set only by
the live view's own route for the holder). The check sits in the batch router, so every way in — the REST
API, the MCP gateway, a task's steps, a fan-out — meets it. Watchers (the live view's streams) are told
of each desktop action sent to the device and of its result, for drawing them on the screen.

In a cluster a hold lives on the node holding the device's connection, since every batch for the device
(asked on any node) is run through that node's router: a live view on another node takes, renews and
releases it there (server/web/screen_nodes.py), and the hold key travels with the person's own batches.
A hold taken with a `ttl` ends by itself when it is not renewed (`keep`) in time, so a hold whose view's
node died does not outlive it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tether.errors import ServerError

if TYPE_CHECKING:
    from tether.server.aip.batches.ledger import PendingBatch, TokenRef

logger = logging.getLogger(__name__)

# the desktop tools that change the screen: refused while a person holds it; drawn on the live view
DESKTOP_ACTIONS = frozenset({"click", "click_element", "press_key", "scroll", "type_text", "ui.findAndClick",
                             "ui.typeText"})


class DesktopHeld(ServerError, RuntimeError):
    """The desktop is held by someone else: `holder` names them."""

    def __init__(self, device: str, holder: str) -> None:
        super().__init__(f"the desktop of device {device} is held by {holder}")
        self.holder = holder


@dataclass(frozen=True, slots=True)
class Hold:
    """A person's hold: `holder` (their token's name), `key` (what their own actions carry), `since` (epoch s),
    `ttl` (seconds it lasts without a `keep`, None: until released)."""

    device: str
    holder: str
    key: str
    since: float
    ttl: float | None = None


@dataclass
class DesktopHolds:
    """The holds and the watchers of each device's desktop, for one node. `clock` (monotonic seconds) times
    the holds' `ttl`."""

    holds: dict[str, Hold] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    _watchers: dict[str, dict[object, Callable[[dict[str, Any]], None]]] = field(default_factory=dict)
    _until: dict[str, float] = field(default_factory=dict)  # device -> when its hold ends unless kept

    def take(self, device: str, holder: str, *, ttl: float | None = None) -> Hold:
        """Hold `device`'s desktop for `holder`, for `ttl` seconds unless kept (None: until released);
        `DesktopHeld` when another holds it (the same holder gets a fresh hold: its older page lost it)."""
        current = self.current(device)
        if current is not None and current.holder != holder:
            raise DesktopHeld(device, current.holder)
        hold = self.holds[device] = Hold(device, holder, secrets.token_urlsafe(16), time.time(), ttl)
        self._until.pop(device, None)
        if ttl is not None:
            self._until[device] = self.clock() + ttl
        self._tell(device, {"kind": "hold", "holder": holder, "since": hold.since})
        return hold

    def current(self, device: str) -> Hold | None:
        """`device`'s hold now, or None (a hold past its `ttl` ends here, its watchers told)."""
        hold = self.holds.get(device)
        if hold is not None and device in self._until and self.clock() > self._until[device]:
            logger.info("the hold of %s on device %s's desktop ran out (not kept for %gs)", hold.holder, device,
                        hold.ttl)
            self.release(device, hold.key)
            return None
        return hold

    def keep(self, device: str, key: str) -> bool:
        """Renew the hold with `key` for its `ttl`; False when it is not the current one (it ran out, was
        released or replaced)."""
        hold = self.current(device)
        if hold is None or hold.key != key:
            return False
        if hold.ttl is not None:
            self._until[device] = self.clock() + hold.ttl
        return True

    def release(self, device: str, key: str) -> bool:
        """End the hold with `key`; False when it is not the current one (already released or replaced)."""
        current = self.holds.get(device)
        if current is None or current.key != key:
            return False
        del self.holds[device]
        self._until.pop(device, None)
        self._tell(device, {"kind": "hold", "holder": None})
        return True

    def refusal(self, device: str, tools: list[str], asker: TokenRef | None) -> str | None:
        """Why a batch of `tools` from `asker` may not run on `device` now, or None when it may."""
        current = self.current(device) if device in self.holds else None
        if current is None or not any(t in DESKTOP_ACTIONS for t in tools):
            return None
        if asker is not None and asker.hold == current.key:
            return None
        since = time.strftime("%H:%M:%S UTC", time.gmtime(current.since))
        return (f"refused: a person ({current.holder}) has taken over the desktop of device {device} since {since}; "
                "desktop actions from anyone else are refused until they hand it back in the dashboard's live view")

    def watch(self, device: str, listener: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call `listener(event)` for each desktop action sent to `device` (`kind: "action"`, then
        `kind: "result"`) and each change of its hold (`kind: "hold"`); returns the remover."""
        key = object()
        self._watchers.setdefault(device, {})[key] = listener

        def remove() -> None:
            listeners = self._watchers.get(device, {})
            listeners.pop(key, None)
            if not listeners:
                self._watchers.pop(device, None)

        return remove

    def observe(self, batch: PendingBatch, tasks: set[asyncio.Task[Any]]) -> None:
        """Tell `batch`'s device's watchers of its desktop actions now and of their results when it ends."""
        if batch.device not in self._watchers:
            return
        actions = [c for c in batch.message.actions or [] if c.tool_name in DESKTOP_ACTIONS]
        if not actions:
            return
        by = batch.asker.name if batch.asker is not None else None
        person = bool(batch.asker and batch.asker.hold)  # sent by the person holding the desktop
        for c in actions:
            self._tell(batch.device, {"kind": "action", "call_id": c.call_id, "tool": c.tool_name, "by": by,
                                      "person": person,
                                      "parameters": _shown(c.parameters or {})})

        async def ended() -> None:
            await batch.done.wait()
            for c in actions:
                result = batch.results.get(c.call_id or "")
                body = result.result if result is not None and isinstance(result.result, dict) else {}
                self._tell(batch.device, {
                    "kind": "result", "call_id": c.call_id, "tool": c.tool_name, "person": person,
                    "status": result.status.value if result is not None else "failure",
                    "error": (result.error if result is not None else batch.error) or None,
                    "via": body.get("via"), "x": body.get("x"), "y": body.get("y"),
                    "bounds": (body.get("element") or body.get("clicked") or {}).get("bounds")})

        task = asyncio.create_task(ended(), name=f"desktop-watch-{batch.response_id}")
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def tell(self, device: str, event: dict[str, Any]) -> None:
        """Pass `event` (one a watcher on another node of a cluster was told) to this node's watchers of `device`."""
        self._tell(device, event)

    def _tell(self, device: str, event: dict[str, Any]) -> None:
        for listener in list(self._watchers.get(device, {}).values()):
            try:
                listener(event)
            except Exception:
                logger.exception("desktop watcher failed for device %s", device)


def _shown(parameters: dict[str, Any]) -> dict[str, Any]:
    """What a watcher is shown of an action's parameters: coordinates and targets, text cut to 200 chars."""
    keep = ("x", "y", "button", "key", "direction", "amount", "control_id", "role", "name", "label", "text")
    return {k: (v[:200] if isinstance(v, str) else v) for k, v in parameters.items() if k in keep}
