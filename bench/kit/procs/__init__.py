"""Real processes for the benches: `fleet` (a `tether server` and client processes of many devices), `cluster`
(clustered server nodes with their Redis and device processes), `timing` (wall and CPU of whole processes)."""
