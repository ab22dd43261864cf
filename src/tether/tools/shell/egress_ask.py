"""`ask: on-miss` for a shell command: an unlisted host is put to a person while the connection waits.

The egress proxy (`tether.sandbox.egress.proxy`) calls the command's asker with the host and port a
sandboxed command asked for and the policy does not list. The asker puts the question where a command's
questions go — an `elicitation` event of the running command, the channel an external MCP server's
questions use — so the person answers it the same way (`POST /api/v1/devices/{name}/questions/{id}`, the
CLI at a terminal), and the server's rule for who may answer holds (a person, never an agent; it asks for
consent, so with four-eyes on not the command's caller). The answer is one of `once` (this connection),
`always` (the host joins the device's policy as an exact `host:port` entry) or `deny`; a decline, a
cancel or anything else is a deny. The wait is bounded by the command's own time left and by
`ASK_TIMEOUT_S`; no answer in time refuses the connection, naming `network.ask`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from typing import TYPE_CHECKING, Any

from tether.tools.context import ToolContext
from tether.tools.policy.model import NetworkRules, Policy

if TYPE_CHECKING:  # the proxy itself only where a sandbox makes one (`tether.tools.running.sandboxing.make_sandbox`)
    from tether.sandbox.egress.proxy import Answer, AskFn

logger = logging.getLogger(__name__)

ASK_TIMEOUT_S = 300.0  # the longest a connection waits for a person
ASK_MARGIN_S = 1.0  # the refusal reaches the command this long before its own timeout ends it
SERVER = "tether.egress"  # the `server` its questions name (no MCP server asks these)
CHOICES = ("once", "always", "deny")
SCHEMA: dict[str, Any] = {"type": "object", "properties": {"answer": {
    "type": "string", "enum": list(CHOICES), "description": "once: this connection; always: add the host to the "
                                                            "device's network allow list; deny: refuse it"}},
    "required": ["answer"]}


def egress_asker(ctx: ToolContext, timeout: float | None) -> AskFn | None:
    """The asker for one command's unlisted hosts, or None where nobody can be asked (the device has no way
    to put a question to a person: the host is then refused as `network.not-allowed`). `timeout` is the
    command's own, starting now; with the call's deadline (`ctx.deadline`) it bounds every wait, so a
    refusal reaches the command before it is ended (None and no deadline: `ASK_TIMEOUT_S` alone)."""
    ask_person = ctx.ask_person
    if ask_person is None:
        return None
    ends = [ctx.deadline, None if timeout is None else asyncio.get_running_loop().time() + timeout]
    deadline = min((e for e in ends if e is not None), default=None)

    async def ask(host: str, port: int, owner: int | None) -> Answer | None:
        loop = asyncio.get_running_loop()
        bound = ASK_TIMEOUT_S if deadline is None else min(ASK_TIMEOUT_S, deadline - loop.time() - ASK_MARGIN_S)
        if bound <= 0:
            raise TimeoutError("no time was left in the command to ask a person")
        question = f"egress-{uuid.uuid4().hex[:16]}"
        message = (f"A sandboxed command wants to connect to {host}:{port}, which the device's network policy "
                   "does not list. Allow it once, always (added to the device's network allow list), or deny?")
        ctx.emit("elicitation", {"id": question, "server": SERVER, "call_id": ctx.call_id, "message": message,
                                 "schema": SCHEMA, "egress": {"host": host, "port": port}})
        action: str = "cancel"
        choice: Answer = "deny"
        content: dict[str, Any] | None = None
        try:
            async with asyncio.timeout(bound):
                action, content = await ask_person(question, message, dict(SCHEMA))
        except TimeoutError:
            raise TimeoutError(f"nobody answered within {bound:g}s") from None
        finally:
            picked = content.get("answer") if action == "accept" and isinstance(content, dict) else None
            if picked == "once" or picked == "always":
                choice = picked
            ctx.emit("elicitation_answered", {"id": question, "call_id": ctx.call_id, "server": SERVER,
                                              "action": action, "answer": choice})
        if choice == "always":
            entry = remember(ctx, host, port)
            sandbox = ctx.sandbox
            if sandbox is not None and sandbox.kept is not None:  # back after a restart (tether.sandbox.kept);
                try:  # the server's audit of the question names the person
                    await sandbox.offload(functools.partial(sandbox.kept.add_grant, entry, question=question,
                                                            call=ctx.call_id, session=ctx.session_id))
                except OSError as exc:
                    logger.warning("network: %s could not be kept for the next start: %s", entry, exc)
        return choice

    return ask


def remember(ctx: ToolContext, host: str, port: int) -> str:
    """A person's `always`: an exact `host:port` entry joins the device's live policy (the object every tool
    and a later re-network read), in its own list and, where a server narrowed it, in the device's list
    beneath that asks too (as the proxy's rules take it: `EgressRules.with_allowed`). Returns the entry."""
    entry = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    _allow(ctx.policy.network if isinstance(ctx.policy.network, NetworkRules) else None, entry)
    logger.warning("network: %s added to the device's network allow list by a person's 'always' (call %s)",
                   entry, ctx.call_id)
    return entry


def _allow(rules: NetworkRules | None, entry: str) -> None:
    while rules is not None:
        if entry not in rules.allow:
            rules.allow.append(entry)
        rules = rules.within if rules.within is not None and rules.within.ask == "on-miss" else None


def with_grants(policy: Policy, grants: list[dict[str, Any]]) -> Policy:
    """`policy` with the `always` grants an earlier run kept (`tether.sandbox.kept`) back in its network
    allow list, as `remember` put them there; unchanged when its network lists no hosts (on, off) or
    nothing was kept. A kept entry the policy denies stays denied (deny wins in the proxy's rules)."""
    if not grants or not isinstance(policy.network, NetworkRules):
        return policy
    network = policy.network.model_copy(deep=True)
    for grant in grants:
        _allow(network, grant["entry"])
    logger.info("network: %d host(s) a person allowed 'always' are back in the allow list", len(grants))
    return policy.model_copy(update={"network": network})
