"""Several agent servers as one, on Redis (`tether server --cluster redis://…`; docs/scaling.md).

- `directory.py`: leases in Redis — which nodes are alive, which node holds each device's socket;
- `bus.py`: requests with streamed partial replies between nodes (Redis Streams), and broadcasts;
- `routing.py`: a batch for a device another node holds, run there and answered here;
- `node.py`: `ClusterNode`, this server as a node — claims, heartbeat, the view of other nodes'
  devices, the relay of task events, and the `RemoteDevices` the hub hands batches to.

The hub never imports this package: the app starts a `ClusterNode` when configured and sets it as
`hub.remote` (server/ports.py), the way the app hands the hub its settings.
"""
