"""Messages between the nodes of a cluster over Redis: requests with streamed partial replies, and
broadcasts.

Its parts: messages.py (limits, failures, a waiting request), inbox.py (the Redis Stream), core.py (state and
sending, links or Redis), asking.py and answering.py (the two sides), end.py (`Bus`, made of both).

Each node reads one inbox, a Redis Stream (`tether:inbox:<node>`). A request carries an id and the
asking node; the node that handles it sends zero or more `part` messages (a command's output as it
streams) and one `done` (the result or an error) to the asker's inbox. Streams rather than pub/sub
for requests: their round trips are alike, and a stream keeps a message while a node reconnects to Redis
where pub/sub drops it. Broadcasts (device and task events every node's followers see) are
pub/sub: a follower that was away re-reads its state anyway.

A node reads its inbox from the moment it starts: requests sent to an earlier incarnation of the
node are not answered, and their askers time out as they would with a device gone.

With `lookup` and `read_secret` given, messages to a node go over a direct link to it (link.py) while
one is open, and through its inbox otherwise; what arrives either way is handled alike. A request
waiting on an answer over a link that drops is sent again through Redis with the same id (the
answering node ignores a repeat of a request it is still running) when its kind may run twice
(`RESENDABLE`: a batch keeps its ids, and its device answers a repeat from its record); any other
kind is answered with an error saying it may have run.
"""

from tether.server.cluster.bus.end import Bus
from tether.server.cluster.bus.messages import (
    INBOX_MAXLEN,
    MAX_MESSAGE_BYTES,
    PREFIX,
    READ_BLOCK_MS,
    REDIS_TIMEOUT_S,
    RESENDABLE,
    STOP_TIMEOUT_S,
    BusError,
    BusInterrupted,
    Handler,
    Send,
)

__all__ = ["INBOX_MAXLEN", "MAX_MESSAGE_BYTES", "PREFIX", "READ_BLOCK_MS", "REDIS_TIMEOUT_S", "RESENDABLE",
           "STOP_TIMEOUT_S", "Bus", "BusError", "BusInterrupted", "Handler", "Send"]
