"""`BatchRunner`: the device's side of a COMMAND — in arrival order per session, exactly once.

Seed 001 runs one task at a time under `task_lock`; here that lock is per session: a session's
batches run one at a time in arrival order, while batches of different sessions (a batch's
`session_id`; batches without one form one session) run side by side, at most
`max_concurrent_sessions` at once. A session beyond that waits for a slot, first come first
served, and its waiting batch is told its place with a `queued` event (`data.position`, 1 = next)
whenever the place changes. A batch that only lists tools waits for nothing: it answers from
what the device already knows, so a listing never sits behind a running command.
Each batch has a task of its own, so the connection's reader stays free to answer heartbeats and
cancellations while batches run.
Batches belong to the runner, not to a connection: a dropped socket does not cancel work, and
the results land in the outbox to be delivered after the next registration.

Each result goes out as soon as it exists (one frame per result, CONTINUE then a final COMPLETED;
a one-command batch is a single COMPLETED frame). A batch's `timeout` and a server CANCEL cancel
the running tool — tools kill their process groups on cancellation — and every command without a
result gets a failure saying why. Commands that started are kept in the `FinishedRecord` under
their batch's server-issued `response_id` and their `call_id`: the same batch sent again (after a
reconnect) is answered from it and never run twice, while another batch that reuses a `call_id`
(a caller's label) is a new call — it neither runs twice nor receives someone else's result.

The package's parts, each with one job: `reasons` (the default session limit and failure wordings), `results`
(results and events into the outbox), `running` (the line, a batch's run, cancel and finish), `accepting`
(`submit`, `run_here`, `outcome_of`, stopping every batch) and `core` (the `BatchRunner` made of them).
"""

from tether.device.link.batch_runner.core import BatchRunner
from tether.device.link.batch_runner.reasons import (
    CANCELLED_BY_SERVER,
    DEFAULT_MAX_CONCURRENT_SESSIONS,
    SHUTDOWN_WHILE_RUNNING,
    SHUTTING_DOWN,
)

__all__ = ["CANCELLED_BY_SERVER", "DEFAULT_MAX_CONCURRENT_SESSIONS", "SHUTDOWN_WHILE_RUNNING", "SHUTTING_DOWN",
           "BatchRunner"]
