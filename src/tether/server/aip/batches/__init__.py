"""Batches in flight: the ledger, where each goes (here, queued, another node), the dispatcher a caller
uses, fan-out over the fleet, and the hub's routing face."""
