"""`Router`: both sides of batches across nodes, for one node."""

from __future__ import annotations

from tether.server.cluster.routing.asking import AskingSide
from tether.server.cluster.routing.holding import HoldingSide


class Router(AskingSide, HoldingSide):
    """Runs batches on other nodes for this node's hub, and other nodes' batches on this node's hub.

    Built with `(hub, registry, store, settings, bus, node, holder)`: `registry` is the hub's (who is
    connected here), `store` records outcomes whose asker is gone, `settings` gives the timeouts, `bus` carries
    the requests, `node` is this node's name, and `holder(device, fresh=True)` asks the directory who holds a
    device."""
