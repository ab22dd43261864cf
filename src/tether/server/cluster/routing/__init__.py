"""Batches across nodes: the asking node's side (`Router.run_batch`, asking.py) and the holding node's
(`serve_*`, holding.py); core.py holds what both share (routes, the results' codec, outcomes kept for other
nodes), router.py the `Router` made of both.

A batch for a device whose socket another node holds is sent to that node over the bus with its
ids unchanged; that node runs it through its own hub (`here_only`: it never forwards again, so a
stale directory cannot make two nodes bounce a batch between them) and streams the device's events
back as partial replies, then the results. What stays on the asking node: the caller, its timeout,
its cancellation and the audit rows — one row per command, written where the caller asked.

When the device moves meanwhile (its node died, or the device reconnected elsewhere), the batch is
sent again, with the same `response_id` and `call_id`s, to the node holding it now: the device runs
a call once and answers a repeat from its record of finished calls, exactly as it does when it
reconnects to a single server (at-least-once delivery, exactly-once execution). A device that is
held by no node for longer than the grace period fails the batch, as on a single server.
"""

from tether.server.cluster.routing.core import (
    ANSWER_TIMEOUT_S,
    ANSWERED_MEMORY,
    MAX_REROUTES,
    NOT_HERE,
    RESULTS,
    Route,
)
from tether.server.cluster.routing.router import Router

__all__ = ["ANSWERED_MEMORY", "ANSWER_TIMEOUT_S", "MAX_REROUTES", "NOT_HERE", "RESULTS", "Route", "Router"]
