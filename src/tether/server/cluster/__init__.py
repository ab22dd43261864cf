"""Several agent servers as one, on Redis (`tether server --cluster redis://…`; docs/scaling.md).

- `directory.py`: leases in Redis — which nodes are alive, which node holds each device's socket;
- `bus/`: requests with streamed partial replies between nodes (Redis Streams), and broadcasts;
- `routing/`: a batch for a device another node holds, run there and answered here;
- `node/`: `ClusterNode`, this server as a node — claims, heartbeat, the view of other nodes'
  devices, the relay of task events, and the `RemoteDevices` the hub hands batches to.

The hub never imports this package: the app gives the hub a `RemoteSlot` (server/ports.py) when it builds
it, and starts a `ClusterNode` with the same slot when configured; the node attaches itself there while
it runs.
"""
