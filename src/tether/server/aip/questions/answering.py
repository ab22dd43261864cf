"""`DeviceHub`'s part for what external MCP servers ask through a device: events carrying questions,
the open questions, a person's answer and its audit."""

from __future__ import annotations

import logging
from typing import Any

from tether.protocol.messages import (
    Event,
    ServerMessage,
    ServerMessageType,
    TaskStatus,
)
from tether.server.aip.batches.ledger import PendingBatch, TokenRef
from tether.server.aip.hub_state import HubState
from tether.server.aip.questions.asked import asks_consent
from tether.server.store import StoreUnavailable
from tether.server.store.audit.table import AuditRow
from tether.server.trust.approvals import check_answerer, dashboard_url, how_a_person_approves, server_url

logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name


class HubQuestions(HubState):
    """Questions of external MCP servers: noted from batch events, listed, answered."""

    def deliver_event(self, batch: PendingBatch, event: Event) -> None:
        """An event of `batch` from its device (here, or through the node holding it): its questions are
        remembered for answers, and the batch's caller gets it. A question names whose it is (`asker`, the
        caller's token, and `asker_agent`) and whether it asks for consent (`approval`), so the person who
        sees it knows who asked and who may answer."""
        if event.kind.startswith("elicitation"):
            if event.kind == "elicitation" and "id" in event.data:
                event = event.model_copy(update={"data": {
                    **event.data, "asker": batch.asker.name if batch.asker is not None else None,
                    "asker_agent": batch.asker.agent if batch.asker is not None else None,
                    "approval": asks_consent(event.data.get("schema"))}})
            self._questions.note(batch.device, event)
            self._question_changed(batch, event)
        if batch.on_event is not None:
            try:
                batch.on_event(event)
            except Exception:
                logger.exception("on_event callback of batch %s failed", batch.response_id)

    def _question_changed(self, batch: PendingBatch, event: Event) -> None:
        """Tell the inbox that a question was asked or answered, and webhooks that one waits for a person."""
        if self.notifier is None:
            return
        if event.kind != "elicitation" or "id" not in event.data or "declined" in event.data:
            self.notifier.changes.bump()
            return
        consent = bool(event.data.get("approval"))
        record = self.registry.get(batch.device)
        asker = batch.asker.name if batch.asker is not None else None
        self.notifier.emit(
            "approval.needed",
            f"{'Approval' if consent else 'An answer'} needed on {batch.device}: "
            f"{str(event.data.get('message', ''))[:300]}",
            {"Device": batch.device, "Asked by": f"MCP server {event.data.get('server') or '?'}",
             "For": asker, "Question": f"{batch.device}/{event.data['id']}"},
            data={"kind": "device_question", "device": batch.device, "question": str(event.data["id"]),
                  "approval": consent, "message": str(event.data.get("message", ""))[:2000], "asker": asker},
            devices=[(batch.device, record.tags if record is not None else [])],
            answer_scope="approve" if consent else "execute", asker=asker,
            link=dashboard_url(server_url(self.settings)))

    def open_questions(self) -> list[dict[str, Any]]:
        """The questions external MCP servers asked that a batch still waits on (`OpenQuestions.listed`), oldest
        first, each with the batch's caller (`asker`)."""
        return [q for q in self._questions.listed() if self.pending(str(q.get("batch") or "")) is not None]

    async def answer_question(self, device: str, question: str, action: str,
                              content: dict[str, Any] | None, *, by: str, answerer: TokenRef | None = None) -> bool:
        """Send a person's answer to the question an external MCP server of `device` asked; False when
        no running batch of that device waits for it (answered, timed out, finished, never asked).

        `answerer` is the API token answering: `approvals.ApprovalRefused` (nothing sent, the question
        still waits) unless it may answer this batch's question (`approvals.check_answerer`: its caller's
        own, a person for an agent's command, another person for a consent question under four-eyes).
        None is for a caller that decided itself (a task's question, through the task's route)."""
        response_id = self._questions.batch_of(device, question)
        batch = self._batches.pending.get(response_id or "")
        conn = self._conns.get(device)
        if response_id is None or batch is None or batch.device != device:
            self._questions.forget(device, question)
            return False
        if answerer is not None:
            check_answerer(batch.asker, answerer, consent=self._questions.consent(device, question),
                           four_eyes=bool(getattr(self.settings, "four_eyes", False)),
                           what=f"answer question '{question}' of device '{device}'",
                           how=how_a_person_approves(server_url(self.settings), device=device, question=question))
        if batch.remote is not None and self.remote is not None:  # asked on the node holding the device, which
            # checks the answerer again and records a network answer before its device gets it (one row)
            answered = await self.remote.answer_question(device, question, action, content, by, answerer)
            self._questions.forget(device, question)
            return answered
        egress = self._questions.egress(device, question)
        if conn is None or not conn.ready:
            raise LookupError(f"device {device} is offline")
        frame = ServerMessage(type=ServerMessageType.ELICITATION_ANSWER, response_id=response_id,
                              status=TaskStatus.OK, payload={"id": question, "action": action, "content": content})
        if egress is not None:  # a network decision is recorded before it reaches the device, or not sent
            unrecorded = await self.store.audit.sent_grouped([self._egress_row(device, egress, action, content, by,
                                                                               response_id)])
            if unrecorded is not None:
                raise StoreUnavailable(f"the answer was not sent (the question still waits): {unrecorded}")
        if not await conn.send(frame):
            if egress is not None:
                self.store.audit.record(by, device, None, "network.ask", {**egress, "delivered": False}, "failure",
                                        "not delivered: the device went offline", response_id=response_id)
            raise LookupError(f"device {device} went offline before the answer reached it")
        self._questions.forget(device, question)
        if self.notifier is not None:
            self.notifier.changes.bump()
        logger.info("question %s of device %s (batch %s) answered by %s: %s", question, device, response_id, by,
                    action)
        return True

    @staticmethod
    def _egress_row(device: str, egress: dict[str, Any], action: str, content: dict[str, Any] | None, by: str,
                    response_id: str) -> AuditRow:
        """A person's answer to `ask: on-miss`, as audited with who gave it; `always` is a change of the device's
        network policy (the device adds the exact host:port to its allow list), recorded as `network.allow`."""
        choice = str((content or {}).get("answer")) if action == "accept" else "deny"
        return (by, device, None, "network.allow" if choice == "always" else "network.ask",
                {**egress, "answer": choice}, "success", None, response_id, None, None)
