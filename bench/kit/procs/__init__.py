"""Real processes for the benches: `fleet` (a `tether server` and client processes of many devices), `cluster`
(clustered server nodes with their Redis and device processes), `devices` (real `tether device` processes, one per
token), `timing` (wall and CPU of whole processes), `cpu` (CPU, run-queue waits and py-spy profiles of live
ones)."""
