"""A node's claims: the devices registering here put in the directory (and told to the other nodes), and
released when they are gone for good."""

from __future__ import annotations

import asyncio
import contextlib
import json

from tether.server.cluster.directory import REDIS_TIMEOUT_S, Directory
from tether.server.cluster.node.core import FLEET_CHANNEL, NodeCore


class Claims(NodeCore):
    """`ClusterNode`'s claims of this node's devices."""

    async def claimed(self, device: str) -> None:
        """Return once `device` (registering here) is in the directory, so that when it is told it is
        registered every node can reach it; at once while the backplane is away, and never longer than
        REDIS_TIMEOUT_S (the claim is retried by the heartbeat)."""
        if self._problem is not None:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._claim_waiters.setdefault(device, []).append(done)
        self._fleet_change(device)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await done

    def _fleet_change(self, device: str) -> None:
        """The hub's listener (synchronous): a device registered, left or changed its profile here."""
        self._dirty.add(device)
        self._wake.set()

    async def _claims(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._problem is not None:
                continue  # claimed again, all at once, when the backplane is back (_rejoin)
            devices, self._dirty = self._dirty, set()
            try:
                await self._claim([d for d in devices if self.hub.local(d)])
                for device in devices:
                    if not self.hub.holds(device) and device in self.directory._held:
                        await self._release(device)
            except Exception as exc:
                self._dirty |= devices
                self._fail(exc)
            finally:
                for device in devices:
                    for done in self._claim_waiters.pop(device, ()):
                        if not done.done():
                            done.set_result(None)

    async def _claim(self, devices: list[str]) -> None:
        """Claim `devices` for this node and tell the other nodes, in one pipeline (a registration storm
        of 1,000 devices is a few round trips, not 2,000)."""
        if not devices:
            return
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            async with self.redis.pipeline(transaction=False) as pipe:
                for device in devices:
                    record = self.registry.get(device)
                    pipe.set(Directory.device_key(device), self.node, px=self.directory.lease_ms)
                    # the device process's instance: the node it reconnects to next resumes its batches
                    pipe.publish(FLEET_CHANNEL, json.dumps({"device": device, "node": self.node,
                                                            "instance": record and record.instance_id}))
                await pipe.execute()
        self.directory._held.update(devices)
        for device in devices:
            self.router.device_seen(device, self.node)

    async def _release(self, device: str) -> None:
        if await self.directory.release(device):
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await self.redis.publish(FLEET_CHANNEL, json.dumps({"device": device, "node": None}))
