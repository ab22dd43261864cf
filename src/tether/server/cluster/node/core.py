"""What every part of a cluster node shares: its limits, its Redis clients, its state, and how it marks
the backplane lost."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from tether.errors import ServerError
from tether.server.cluster.directory import PREFIX, REDIS_TIMEOUT_S, Directory
from tether.server.cluster.link import new_secret

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from tether.server.aip.fleet.registry import DeviceRegistry
    from tether.server.aip.hub import DeviceHub
    from tether.server.cluster.bus import Bus
    from tether.server.cluster.fleet import FleetView
    from tether.server.cluster.routing import Router
    from tether.server.cluster.view import HeldSets
    from tether.server.ports import RemoteSlot
    from tether.server.settings import ServerSettings

log = logging.getLogger("tether.cluster")

FLEET_CHANNEL = f"{PREFIX}:events:fleet"
RELAY_CHANNEL = f"{PREFIX}:events:relay"
SECRET_KEY = f"{PREFIX}:link-secret"  # the cluster secret the direct links prove (link.py)
RELAY_QUEUE = 10_000  # events waiting for Redis; past it they are dropped (and followers re-read the store)
MAX_BEAT_S = 5.0  # the heartbeat's longest period: how soon a lost or returned backplane is noticed
REJOIN_S = 0.5  # while the backplane is away, how often the node tries it again
STOP_TIMEOUT_S = 2.0  # a stopping node's goodbye to Redis, and its loops' ends


class ClusterUnavailable(ServerError, RuntimeError):
    """The cluster option cannot work here (the redis package is missing)."""


def redis_client(url: str, read_timeout: float) -> Redis:
    """A Redis client of `url` with the node's timeouts; ClusterUnavailable without the redis package."""
    try:
        import redis.asyncio as aioredis
    except ImportError:
        raise ClusterUnavailable("--cluster needs the redis package: pip install 'tether[cluster]'") from None
    return aioredis.from_url(url, socket_timeout=read_timeout, socket_connect_timeout=REDIS_TIMEOUT_S,
                             health_check_interval=0)


def safe(url: str) -> str:
    """`url` with its password hidden, to be logged."""
    from tether.server.store.engine import safe_url

    return safe_url(url)


class NodeCore:
    """The state of a cluster node (`ClusterNode` builds it); its claims, relay, membership and the
    hub's calls (claims.py, relay.py, membership.py, remote.py) build on it."""

    hub: DeviceHub
    slot: RemoteSlot  # the hub's view of the cluster: this node while it runs
    registry: DeviceRegistry
    settings: ServerSettings
    node: str
    url: str
    redis: Redis
    reader: Redis
    subscriber: Redis
    directory: Directory
    held: HeldSets
    bus: Bus
    router: Router
    view: FleetView
    _problem: str | None
    _alive: set[str]
    _api: dict[str, str]  # node -> its API base URL, as it announced (refreshed every beat)
    # after a rejoin: the nodes alive before it, not seen since, and until when they are given to join
    # again (Redis may have restarted empty; their absence says nothing until they have had a beat)
    _awaited: dict[str, float]
    _dirty: set[str]
    _wake: asyncio.Event
    _claim_waiters: dict[str, list[asyncio.Future[None]]]
    _relayed: asyncio.Queue[str]
    _relay_listeners: dict[str, dict[object, Any]]

    def problem(self) -> str | None:
        return None if self._problem is None else f"cluster backplane unavailable: {self._problem}"

    def _fail(self, exc: BaseException) -> None:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self._problem is None or self._problem == "joining the cluster":
            log.warning("cluster backplane %s unavailable (%s): work for other nodes' devices is refused until "
                        "it is back", safe(self.url), why)
        self._problem = why

    async def _link_url(self, node: str) -> str | None:
        """The link URL `node` announced with its node entry (None: it has none, or is not alive)."""
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            raw = await self.redis.get(Directory.node_key(node))
        try:
            url = json.loads(raw).get("link") if raw else None
        except (ValueError, AttributeError):
            return None
        return url if isinstance(url, str) else None

    async def _link_secret(self) -> str:
        """The cluster secret in Redis, made by the first node that asks."""
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            await self.redis.set(SECRET_KEY, new_secret(), nx=True)
            secret = await self.redis.get(SECRET_KEY)
        if secret is None:
            raise ServerError("the cluster secret vanished from Redis as it was made")
        return secret.decode() if isinstance(secret, bytes) else str(secret)
