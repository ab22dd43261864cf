"""Several agent servers as one, on Redis: who holds which device, and messages between nodes.

Groundwork for scale-out (issue 16), not yet wired into the hub: `directory.py` keeps leases
(a node's liveness, and which node holds each device's socket) and `bus.py` carries requests,
streamed partial replies and broadcasts between nodes. Neither imports the hub: the hub will hand
the bus its handlers, the way the app hands the hub its settings.
"""
