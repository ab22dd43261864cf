"""The reader of a registered link: each server frame, as `DeviceSession` reads it, turned into what it asks
for (a batch run, a cancel, a policy or outcome report, a profile, an answer to an external server's question)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosedOK

from tether.device.link.batch_runner import BatchRunner
from tether.device.link.outbox import Outbox
from tether.device.mcp.client.elicit import RemoteQuestions, RemoteSampler
from tether.device.policy_overlay import RemotePolicy
from tether.protocol.codec import encode
from tether.protocol.device_session import (
    BadFrame,
    CancelArrived,
    CommandsArrived,
    DeviceSession,
    ElicitationAnswer,
    HeartbeatAck,
    OutcomeQuery,
    PolicyRequest,
    ProfileRequested,
    SamplingReply,
    ServerReportedError,
    SessionEvent,
    Unexpected,
)
from tether.protocol.messages import (
    ClientMessage,
    ClientMessageType,
    ServerMessage,
    ServerMessageType,
    TaskStatus,
)
from tether.protocol.profile import DeviceProfile

# the link's records keep the one logger name operators filter on (`tether.device.link.connection`)
logger = logging.getLogger("tether.device.link.connection")


class _Answerers(Protocol):
    """What `Dispatching` reads of `LinkHooks` (`tether.device.link.connection`)."""

    @property
    def policy(self) -> RemotePolicy | None: ...

    @property
    def questions(self) -> RemoteQuestions | None: ...

    @property
    def sampler(self) -> RemoteSampler | None: ...


class Dispatching:
    """`DeviceConnection`'s reader and what each server message asks of the device."""

    name: str | None
    outbox: Outbox
    batches: BatchRunner
    hooks: _Answerers
    _last_rx: float
    _side_tasks: set[asyncio.Task[None]]

    if TYPE_CHECKING:
        async def _collect_profile(self) -> DeviceProfile: ...

    async def _reader(self, ws: ClientConnection, session: DeviceSession, hand_over: Callable[[], None]) -> None:
        """Read frames until the socket closes and act on what `session` says each one means. A COMMAND that can
        start at once runs right here, in this task (most finish without waiting: no task, no event-loop turn
        on the round trip); if it has to wait, `hand_over` gives the socket to a new reader first, and this
        task ends with the batch."""
        loop = asyncio.get_running_loop()
        receive = session.receive_open
        while True:
            try:
                raw = await ws.recv()
            except ConnectionClosedOK:
                return
            self._last_rx = loop.time()
            event = receive(raw)
            if type(event) is HeartbeatAck:
                self.outbox.heartbeat_answered()  # the results written before our heartbeat are the server's
            elif type(event) is CommandsArrived:
                batch = self.batches.submit(event.batch, run_here=True)
                if batch is not None and await self.batches.run_here(batch, hand_over):
                    return
            else:
                self._act(session, event)

    def _act(self, session: DeviceSession, event: SessionEvent) -> None:
        """Do what a server message other than a COMMAND or a heartbeat asks."""
        if isinstance(event, BadFrame):
            logger.warning("bad frame from the server (%s): %s", event.reason, event.error)
            self.outbox.put_control(session.error_frame(f"{event.reason}: {event.error}"))
        elif isinstance(event, CancelArrived):
            if not self.batches.cancel(event.response_id):
                logger.info("cancel for %s: no such batch queued or running", event.response_id)
        elif isinstance(event, HeartbeatAck):  # liveness was noted on arrival
            self.outbox.heartbeat_answered()
        elif isinstance(event, PolicyRequest):
            self._answer_policy(event.message)
        elif isinstance(event, OutcomeQuery):
            self._answer_outcomes(event)
        elif isinstance(event, ProfileRequested):
            task = asyncio.create_task(self._send_device_info(event.response_id))
            self._side_tasks.add(task)
            task.add_done_callback(self._side_tasks.discard)
        elif isinstance(event, ElicitationAnswer):
            if self.hooks.questions is not None:
                self.hooks.questions.answer(event.payload)
        elif isinstance(event, SamplingReply):
            if self.hooks.sampler is not None:
                self.hooks.sampler.reply(event.message)
        elif isinstance(event, ServerReportedError):
            logger.warning("the server reports an error: %s", event.error)
        elif isinstance(event, Unexpected):
            logger.info("ignoring an unexpected %s from the server", event.type.value)
        elif isinstance(event, CommandsArrived):
            self.batches.submit(event.batch)

    def _answer_policy(self, msg: ServerMessage) -> None:
        """Show or change the policy for the server (`tether policy`): one POLICY_REPORT either way; a
        refused or invalid change is a FAILED report saying why, and changes nothing."""
        reply = ClientMessage(type=ClientMessageType.POLICY_REPORT, client_id=self.name,
                              prev_response_id=msg.response_id)
        policy = self.hooks.policy
        try:
            if policy is None:
                raise ValueError("this device does not take policy requests from its server")
            if msg.type is ServerMessageType.POLICY_SET:
                payload = msg.payload or {}
                reply.payload = policy.apply(payload.get("policy") or {}, replace=payload.get("replace") is True)
            else:
                reply.payload = policy.report()
        except ValueError as exc:
            reply.status, reply.error = TaskStatus.FAILED, str(exc)[:2000]
        except OSError as exc:
            reply.status, reply.error = TaskStatus.FAILED, f"the device could not save its policy: {exc}"
        self.outbox.put_control(encode(reply))

    def _answer_outcomes(self, query: OutcomeQuery) -> None:
        """An OUTCOME_QUERY: one OUTCOME_REPORT from the record of finished calls and the batches in hand;
        nothing is run, queued or changed for it (a finished result stays in the outbox until acknowledged)."""
        outcomes = [self.batches.outcome_of(call.call_id, call.response_id).model_dump(mode="json", exclude_none=True)
                    for call in query.calls]
        self.outbox.put_control(encode(ClientMessage(type=ClientMessageType.OUTCOME_REPORT, client_id=self.name,
                                                     prev_response_id=query.response_id,
                                                     payload={"outcomes": outcomes})))

    async def _send_device_info(self, response_id: str | None) -> None:
        profile = await self._collect_profile()
        self.outbox.put_control(encode(ClientMessage(type=ClientMessageType.DEVICE_INFO, client_id=self.name,
                                                     prev_response_id=response_id,
                                                     payload=profile.model_dump(mode="json"))))
