"""What the hub and the API ask of a cluster node (`RemoteDevices`, server/ports.py): who holds a device,
batches, requests, cancels and answers for devices held elsewhere, and the node's health."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from tether.server.cluster.directory import REDIS_TIMEOUT_S, Directory
from tether.server.cluster.node.core import NodeCore
from tether.server.ports import BackplaneUnavailable

if TYPE_CHECKING:
    from tether.protocol.messages import ClientMessage, ServerMessage
    from tether.server.aip.batches.ledger import PendingBatch, TokenRef


class RemoteSide(NodeCore):
    """`ClusterNode`'s answers to the hub and the API."""

    async def holder(self, device: str, *, fresh: bool = False) -> str | None:
        """The live node holding `device` now: as the broadcasts told this node, or (`fresh`, or when they
        did not) as the directory says."""
        if self._problem is not None:
            raise BackplaneUnavailable(self.problem())
        record = None if fresh else self.registry.get(device)
        if record is not None and record.connected and record.node in self._alive:
            # what the broadcasts said: no Redis round trip per command. A stale answer costs one retry:
            # that node answers "not held here" and the Router asks the directory (Router._wait_holder)
            return record.node
        try:
            node = await self.directory.holder(device)
            if node is not None and node != self.node and node not in self._alive:
                async with asyncio.timeout(REDIS_TIMEOUT_S):  # a node that joined since the last beat?
                    if not await self.redis.exists(Directory.node_key(node)):
                        return None  # a dead node's lease not expired yet: nobody holds it
                self._alive.add(node)
        except Exception as exc:
            self._fail(exc)
            raise BackplaneUnavailable(self.problem()) from None
        return node

    def hint(self, device: str) -> str | None:
        record = self.registry.get(device)
        if record is None or record.node is None or record.node == self.node or record.node not in self._alive:
            return None
        return self._api.get(record.node)

    async def run_batch(self, batch: PendingBatch, holder: str) -> None:
        await self.router.run_batch(batch, holder)

    async def request(self, holder: str, device: str, message: ServerMessage, timeout: float) -> ClientMessage:
        return await self.router.request(holder, device, message, timeout)

    async def cancel(self, response_id: str, reason: str) -> bool:
        if self._problem is not None:
            return False
        return await self.router.cancel(sorted(self._alive), response_id, reason)

    async def answer_question(self, device: str, question: str, action: str, content: dict[str, Any] | None,
                              by: str, answerer: TokenRef | None = None) -> bool:
        holder = await self.holder(device)
        if holder is None or holder == self.node:
            return False
        return await self.router.answer(holder, {"device": device, "question": question, "action": action,
                                                 "content": content, "by": by,
                                                 "answerer": answerer.to_dict() if answerer is not None else None})

    async def call(self, node: str, kind: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self._problem is not None:
            raise BackplaneUnavailable(self.problem())
        return await self.bus.call(node, kind, body, timeout)

    def handle(self, kind: str, handler: Any) -> None:
        async def answer(body: dict[str, Any], send: Any) -> dict[str, Any]:
            return await handler(body)

        self.bus.handlers[kind] = answer

    def health(self) -> dict[str, Any]:
        """The cluster part of /api/v1/health."""
        return {"node": self.node, "backplane": "ok" if self._problem is None else self.problem(),
                "nodes": sorted(self._alive | {self.node})}
