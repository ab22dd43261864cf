"""What a transfer is asked for and who asks it (`TransferRequest`, `Caller`), and its id (`transfer_id`): the
plain data the transfer service, the REST route and the task skill share."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.server.aip.batches.ledger import TokenRef

TRANSFER_SKILL = "transfer"  # the skill name a plan step uses (agent/tasks)


@dataclass
class TransferRequest:
    """What to send: `source_path` on device `source` to `dest_path` on device `dest` (an existing directory
    there receives it by its name, as `cp` does). `overwrite` lets existing files be replaced (a person
    approves that outside the receiver's temp dir); `max_bytes` and `chunk_bytes` lower the server's caps."""

    source: str
    source_path: str
    dest: str
    dest_path: str
    overwrite: bool = False
    max_bytes: int | None = None
    chunk_bytes: int | None = None


@dataclass
class Caller:
    """Who asks, as the audit names them, the undo session the receiver journals into, and an approval."""

    requested_by: str
    session_id: str | None = None
    approved_by: str | None = None
    approval_digest: str | None = None
    asker: TokenRef | None = None


def transfer_id(source: str, root: str, dest: str, dest_path: str, entries: list[dict[str, Any]]) -> str:
    """A transfer's id: the same for the same content (`entries`, the sender's manifest) sent from the same
    place to the same place, so asking again finds the receiver's partial files and resumes."""
    facts = json.dumps([source, root, dest, dest_path, entries], sort_keys=True, separators=(",", ":"))
    return "t" + hashlib.sha256(facts.encode()).hexdigest()[:31]
