"""The fleet as the hub keeps it: the registry and its index, liveness and grace periods, devices going
away, and the collector kept lean for a large fleet; `schemas` (one copy of each distinct tool list the
devices report) and `scopes` (which devices a scoped API token sees and reaches)."""
