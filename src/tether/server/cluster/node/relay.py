"""A node's relay of task events to followers on the other nodes (Redis pub/sub, in the order they
happened)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tether.server.cluster.directory import REDIS_TIMEOUT_S
from tether.server.cluster.node.core import RELAY_CHANNEL, RELAY_QUEUE, NodeCore, log


class Relays(NodeCore):
    """`ClusterNode`'s relay of events, out and in."""

    def relay(self, topic: str, data: dict[str, Any]) -> None:
        try:
            self._relayed.put_nowait(json.dumps({"relay": topic, "from": self.node, "data": data}, default=str))
        except asyncio.QueueFull:
            log.warning("cluster relay: %d events waiting for Redis; a %s event was dropped", RELAY_QUEUE, topic)

    def on_relay(self, topic: str, listener: Any) -> Any:
        key = object()
        self._relay_listeners.setdefault(topic, {})[key] = listener
        return lambda: self._relay_listeners.get(topic, {}).pop(key, None)

    async def _relay_pump(self) -> None:
        """One publisher for every relayed event: they reach the other nodes in the order they happened."""
        while True:
            text = await self._relayed.get()
            try:
                async with asyncio.timeout(REDIS_TIMEOUT_S):
                    await self.redis.publish(RELAY_CHANNEL, text)
            except Exception as exc:
                self._fail(exc)

    def _on_relay(self, event: dict[str, Any]) -> None:
        if event.get("from") == self.node or not isinstance(event.get("data"), dict):
            return
        for listener in list(self._relay_listeners.get(str(event.get("relay")), {}).values()):
            try:
                listener(event["data"])
            except Exception:
                log.exception("cluster relay listener for %s failed", event.get("relay"))
