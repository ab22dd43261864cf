"""`DeviceHub`'s part for devices going away: a dropped connection, the end of a grace period, a restarted
process, a silent socket, and what is stored of a device."""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial

from tether.protocol.wire import CloseCode
from tether.server.aip.fleet.record import DeviceRecord
from tether.server.aip.hub_state import HubState
from tether.server.aip.sockets.link import DeviceLink, close_socket
from tether.server.trust.approvals import server_url

logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name


class HubLiveness(HubState):
    """Disconnection, grace periods and the device rows kept in the store."""

    def _drop(self, conn: DeviceLink, why: str, *, grace: bool = True) -> None:
        """Forget a connection (idempotent); its device goes offline and its batches wait for grace."""
        if conn.dropped:
            return
        conn.dropped, conn.ready = True, False
        if self._conns.get(conn.name) is not conn:
            return
        del self._conns[conn.name]
        record = conn.record
        record.connected, record.running, record.queued, record.last_seen = False, 0, 0, time.time()
        self._remember(conn.name, None, record.last_seen)
        if grace and not self._closed:
            self._grace.start(conn.name, self.settings.grace_period)
        self.registry.notify()
        self._fleet_changed(conn.name)
        logger.info("device %s offline: %s", conn.name, why)
        if grace and not self._closed and self.notifier is not None:  # not a shutdown, a revocation, a takeover
            self.notifier.emit("device.offline", f"Device {conn.name} went offline ({why})",
                               {"Device": conn.name, "Platform": record.platform, "Why": why},
                               data={"device": conn.name, "why": why, "last_seen": record.last_seen},
                               devices=[(conn.name, record.tags)],
                               link=f"{server_url(self.settings) or 'http://SERVER'}/#/devices/{conn.name}")

    def _grace_expired(self, device: str) -> None:
        if device in self._conns:
            return
        if device in self._arriving:  # it is registering right now: decided when that ends
            self._expired_meanwhile.add(device)
            return
        # given up: if this device process comes back after all, it is told its batches are no longer
        # awaited (not resumed), so it stops running them instead of working for nobody
        record = self.registry.get(device)
        if record is not None:
            if record.instance_id is not None:  # a new process registering later settles what this one owed
                self._given_up[device] = record.instance_id
            record.instance_id = None
        self._batches.forget_cancels(device)
        self._batches.fail_device(device, f"device {device} disconnected and did not come back within the "
                                          f"{self.settings.grace_period:g}s grace period", pending=True)

    def _restarted(self, device: str) -> None:
        """`device` registered as a new process: the outcomes its old one left pending will never come
        (its commands were stopped with it, if they had started), so they are settled as unknown."""
        try:
            settled = self.store.audit.restarted(device)
        except Exception:
            logger.exception("could not settle the pending outcomes of restarted device %s", device)
            return
        if settled:
            logger.warning("device %s restarted: %d pending outcome(s) of its old process settled as unknown",
                           device, settled)

    def _silent(self, conn: DeviceLink, silent: float) -> None:
        self._drop(conn, f"no frame for {silent:.1f}s (timeout {self.settings.heartbeat_timeout:g}s)")
        self._close_conn(conn, CloseCode.HEARTBEAT_TIMEOUT, "heartbeat timeout")


    def _remember(self, device: str, record: DeviceRecord | None, last_seen: float) -> None:
        """Store a device's last_seen, and with `record` its profile (the tool list once per digest)."""
        try:
            profile = record.profile if record is not None else None
            # behind the caller, in order (PostgreSQL: on the store's pool, the loop never waits for it)
            if record is None or profile is None or record.tools_digest is None:
                self.store.soon(self.store.devices.upsert, device, profile.model_dump_json() if profile else None,
                                last_seen)
            else:
                self.store.soon(partial(self.store.devices.upsert, device, profile.model_dump_json(exclude={"tools"}),
                                        last_seen, tools=(record.tools_digest,
                                                          self.registry.tools.dump(profile.tools))))
        except Exception:
            logger.exception("could not store device %s", device)

    def _close_conn(self, conn: DeviceLink, code: int, reason: str) -> None:
        """Close a connection's socket now, from outside its receive loop (which may be blocked)."""
        if conn.closer is None:
            conn.closer = asyncio.ensure_future(close_socket(conn.socket, code, reason))
            self._tasks.add(conn.closer)
            conn.closer.add_done_callback(self._tasks.discard)
