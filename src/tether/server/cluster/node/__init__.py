"""`ClusterNode`: one `tether server --cluster redis://…` process as a node of the cluster.

It keeps three things true while the server runs:
- the directory says which devices this node holds: a device is claimed when it registers here
  (in one pipeline with the broadcast that tells the other nodes) and released when it is gone
  for good (its grace period over), and every claim is renewed by one heartbeat loop;
- this node's registry lists the devices the other nodes hold (`DeviceRecord.node`), from the
  `fleet` broadcasts and, after every (re)join, from the directory itself, and every heartbeat from
  the stored device sets (fleet.py, view.py): a broadcast missed while the node stalled or Redis
  was away is never relied on;
- the hub hands it batches for devices held elsewhere (`RemoteDevices`, server/ports.py), which
  the `Router` runs on the holding node.

Its parts: core.py (limits, Redis clients, state), claims.py, relay.py (task events for followers elsewhere),
membership.py (heartbeat, joins, broadcasts), remote.py (what the hub and the API ask), and cluster_node.py
(`ClusterNode`, made of them).

When Redis cannot be reached the node says so (`problem()`, `/api/v1/health`) and refuses work for
other nodes' devices with a clear 503 instead of guessing where they are; its own devices keep
working. When Redis is back it joins again, claims its devices again and re-reads the directory;
the nodes it knew are given one lease to join again before their devices are shown offline.
"""

from tether.server.cluster.node.cluster_node import ClusterNode
from tether.server.cluster.node.core import (
    FLEET_CHANNEL,
    MAX_BEAT_S,
    REJOIN_S,
    RELAY_CHANNEL,
    RELAY_QUEUE,
    SECRET_KEY,
    STOP_TIMEOUT_S,
    ClusterUnavailable,
)

__all__ = ["FLEET_CHANNEL", "MAX_BEAT_S", "REJOIN_S", "RELAY_CHANNEL", "RELAY_QUEUE", "SECRET_KEY", "STOP_TIMEOUT_S",
           "ClusterNode", "ClusterUnavailable"]
