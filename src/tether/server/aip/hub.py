"""`DeviceHub`: the server end of AIP — one WebSocket per device, the batches in flight, liveness.

The hub is the only place where connections, pending batches and the registry meet, so every
rule about whom to trust lives here: a device is who its token says, proved by its key (the token's
device's enrolled key signs this connection's challenge, `registration.prove_key`); results count only when
they come from the device the batch went to and answer a `call_id` still outstanding; a
dropped device keeps its batches for `grace_period` so a reconnection loses nothing (a device
whose registration is under way when that period ends counts as back in time; one that comes back
later is told its batches are no longer awaited). It never raises for anything a device sends —
a bad frame gets an ERROR reply and the loop goes on.

The hub speaks to an `AIPSocket`, not to Starlette, so the rules stay testable and portable;
`tether.server.aip.socket.aip_route` adapts a Starlette WebSocket to it. What each frame means is
judged by the connection's sans-I/O session (`tether.protocol.server_session`); the hub keeps the table of
connections and acts on those judgements. Where each batch goes and the ledger of batches in flight
(`tether.server.aip.batch_router`, `tether.server.aip.batches`), the liveness timers
(`tether.server.aip.liveness`), the writes to one socket (`tether.server.aip.link`), the judgement of a
registration (`tether.server.aip.registration`) and what external MCP servers ask through a device
(`tether.server.aip.questions`) each live in their own module; the hub is where they meet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from tether.protocol.messages import (
    OUTCOME_UNKNOWN,
    CallOutcome,
    CallRef,
    ClientMessage,
    Event,
    RegisterAck,
    ServerMessage,
    ServerMessageType,
    TaskStatus,
)
from tether.protocol.server_session import (
    BadFrame,
    DeviceReportedError,
    EventArrived,
    HeartbeatArrived,
    OutcomesReported,
    PolicyReported,
    ProfileReported,
    RegistrationRefused,
    ResultsArrived,
    SamplingRequested,
    ServerSession,
    SessionEvent,
)
from tether.protocol.wire import CloseCode
from tether.server.aip.batch_router import BatchRouter
from tether.server.aip.batches import PendingBatch, TokenRef
from tether.server.aip.dispatcher import WebSocketCommandDispatcher
from tether.server.aip.gc_keeper import keep_gc_lean
from tether.server.aip.link import DeviceLink, close_socket
from tether.server.aip.liveness import GracePeriods, watch_liveness
from tether.server.aip.questions import OpenQuestions, Sampler, SamplingGate, answer_sampling, asks_consent
from tether.server.aip.registration import authenticate, prove_key, refusal_of, refuse
from tether.server.aip.registry import DeviceRecord, DeviceRegistry
from tether.server.aip.socket import AIPSocket, Refusal, SocketClosed
from tether.server.approvals import check_answerer, dashboard_url, how_a_person_approves, server_url
from tether.server.ports import BackplaneUnavailable, RemoteDevices, RemoteSlot
from tether.server.settings import ServerSettings
from tether.server.store import Store
from tether.server.store.tokens import TokenInfo

if TYPE_CHECKING:
    from tether.protocol.models import Command
    from tether.protocol.profile import DeviceRequirements
    from tether.server.aip.desktop_holds import DesktopHolds
    from tether.server.aip.fanout import DeviceOutcome
    from tether.server.notify.notifier import Notifier

PRELOAD_AFTER_S = 2.0  # known devices' stored profiles are read this long after start, in the background

logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name


class DeviceHub:
    def __init__(self, store: Store, settings: ServerSettings, registry: DeviceRegistry | None = None, *,
                 remote: RemoteSlot | None = None, sampler: Sampler | None = None,
                 notifier: Notifier | None = None) -> None:
        self.store = store
        # webhooks told when a device goes offline or a question waits for a person; the inbox's live signal
        self.notifier = notifier
        self.settings = settings
        self.registry = registry if registry is not None else DeviceRegistry()
        self._conns: dict[str, DeviceLink] = {}
        self._grace = GracePeriods(self._grace_expired)
        self._arriving: dict[str, int] = {}  # devices whose authenticated registration is under way
        self._expired_meanwhile: set[str] = set()  # ... and whose grace period ended during it
        self._given_up: dict[str, str] = {}  # device -> the process (instance_id) given up after its grace
        self._tasks: set[asyncio.Task[Any]] = set()
        # the batches in flight and where each goes (here, queued for a returning device, another node)
        self._router = BatchRouter(self._conns, self._grace, self.registry, store.audit, self._tasks,
                                   remote if remote is not None else RemoteSlot())
        self._batches = self._router.book
        self._replies: dict[str, tuple[str, asyncio.Future[ClientMessage]]] = {}  # request id → (device, answer)
        # questions external MCP servers asked during a batch (its `elicitation` events): (device, id) → batch
        self._questions = OpenQuestions()
        self._sampling = SamplingGate()  # who may cause a sampling request, and how many (aip/questions.py)
        # answers devices' sampling requests with the server's LLM: (device, request payload) → (text, model);
        # None where the server has no LLM: such requests are refused
        self.sampler = sampler
        self._liveness: asyncio.Task[None] | None = None
        self._preload: asyncio.Task[int] | None = None  # reads known devices' stored profiles after start
        self._gc: asyncio.Task[None] | None = None  # keeps a large fleet's connections out of full collections
        self._closed = False
        # told the device's name when one registers, leaves or reports new tools (the MCP gateway's
        # tools/list_changed); not on load changes, which happen twice per batch
        self._fleet_listeners: dict[object, Callable[[str], None]] = {}

    # -- life ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load known devices (listed as offline until they connect) and start the liveness watch.
        Only their names, platforms and tags are read now; a profile is read when first asked for, so a
        large fleet's profiles are not validated before the server answers /health."""
        self.registry.profile_loader = self.store.devices.profile
        for name, tags in self.store.devices.tag_overrides().items():  # tags an admin set (docs/fleet.md)
            self.registry.override_tags(name, tags)
        for name, last_seen, platform, tags, stored in self.store.devices.heads():
            self.registry.known(name, last_seen, platform, tags, stored)
        self._preload = asyncio.create_task(self.registry.preload(start_after=PRELOAD_AFTER_S),
                                            name="tether-hub-preload")
        self._liveness = asyncio.create_task(
            watch_liveness(self.settings, self._conns, on_silent=self._silent, check_tokens=self._enforce_revocations),
            name="tether-hub-liveness")
        self._gc = asyncio.create_task(keep_gc_lean(lambda: len(self._conns)), name="tether-hub-gc")

    async def aclose(self) -> None:
        """Fail what is pending, close every device socket (1001) and stop the timers."""
        self._closed = True
        self._router.close()
        if self._liveness is not None:
            self._liveness.cancel()
        if self._preload is not None:
            self._preload.cancel()
        if self._gc is not None:
            self._gc.cancel()
        self._grace.cancel_all()
        self._batches.finish_all("the server is shutting down", pending=True)
        for conn in list(self._conns.values()):
            self._drop(conn, "server shutdown", grace=False)
            self._close_conn(conn, CloseCode.GOING_AWAY, "server shutting down")
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def dispatcher(self, device: str, *, session_id: str | None = None, agent_name: str | None = None,
                   process_name: str | None = None, root_name: str | None = None,
                   on_event: Callable[[Event], None] | None = None,
                   requested_by: str = "unknown", asker: TokenRef | None = None) -> WebSocketCommandDispatcher:
        """A dispatcher for `device` whose batches go through this hub and are audited in its store;
        `asker` is the API token they run for (the one their MCP servers' questions belong to)."""
        return WebSocketCommandDispatcher(self._router, self.store.audit, device,
                                          default_timeout=self.settings.default_command_timeout,
                                          session_id=session_id, agent_name=agent_name,
                                          process_name=process_name, root_name=root_name, on_event=on_event,
                                          requested_by=requested_by, asker=asker)

    def connected(self, device: str) -> bool:
        """Whether a batch for `device` can go out now: its socket is here, or another node holds it."""
        if device in self._conns:
            return True
        record = self.registry.get(device) if self.remote is not None else None
        return record is not None and record.node is not None and record.connected

    @property
    def desktop(self) -> DesktopHolds:
        """Persons' holds on devices' desktops and the live views watching them (server/aip/desktop_holds.py)."""
        return self._router.desktop

    def local(self, device: str) -> bool:
        """Whether `device`'s socket is connected to this node."""
        return device in self._conns

    def local_devices(self) -> list[str]:
        return list(self._conns)

    def pending(self, response_id: str) -> PendingBatch | None:
        """The batch in flight with this id (started or held here), or None."""
        return self._router.pending(response_id)

    def fleet_changed(self, device: str) -> None:
        """Tell the fleet listeners (the MCP gateway's tools/list_changed) that `device` changed elsewhere."""
        self._fleet_changed(device)

    def holds(self, device: str) -> bool:
        """Whether this node holds `device`'s socket (or keeps its batches through its grace period)."""
        return device in self._conns or device in self._grace

    async def fan_out(self, requires: DeviceRequirements, commands: list[Command], *,
                      on_outcome: Callable[[DeviceOutcome], None] | None = None, **options: Any) -> dict[str, Any]:
        """Run `commands` on every device meeting `requires` (server/aip/fanout.py) and return
        `{"devices": [lines…], "summary": {…}}`: how a layer above (a task step `on: all`) fans out
        without importing the server's modules. `FanOutError` (a ValueError) when it cannot start."""
        from tether.server.aip.fanout import countable, run_fan_out

        # a device whose every token is revoked is not counted (docs/fleet.md)
        active = await self.store.call(self.store.tokens.active_device_names)  # off the event loop (PostgreSQL)
        options["within"] = countable(active, options.get("within"))
        return await run_fan_out(self, self.registry, requires, commands, on_outcome=on_outcome, **options)

    def on_fleet_change(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call `listener(device)` whenever a device registers, goes offline or reports a new profile
        (its tools may have changed); returns the callable that removes it. Listeners must not block."""
        key = object()
        self._fleet_listeners[key] = listener

        def remove() -> None:
            self._fleet_listeners.pop(key, None)

        return remove

    def _fleet_changed(self, device: str) -> None:
        for listener in list(self._fleet_listeners.values()):
            try:
                listener(device)
            except Exception:
                logger.exception("fleet listener failed for device %s", device)

    async def request(self, device: str, message: ServerMessage, timeout: float, *,
                      here_only: bool = False) -> ClientMessage:
        """Send a request frame (e.g. POLICY_SET) to a connected device and wait, at most `timeout`
        seconds, for the frame that answers its `response_id` from that same device (in a cluster,
        through the node holding it, unless `here_only`). LookupError when the device is not
        connected, TimeoutError when no answer came."""
        conn = self._conns.get(device)
        if (conn is None or not conn.ready) and self.remote is not None and not here_only:
            try:
                holder = await self.remote.holder(device)
            except BackplaneUnavailable as exc:
                raise LookupError(str(exc)) from None
            if holder is not None and holder != self.remote.node:
                return await self.remote.request(holder, device, message, timeout)
        if conn is None or not conn.ready:
            raise LookupError(f"device {device} is offline" if self.registry.get(device)
                              else f"no device named {device} has registered")
        answer: asyncio.Future[ClientMessage] = asyncio.get_running_loop().create_future()
        self._replies[message.response_id] = (device, answer)
        try:
            async with asyncio.timeout(timeout):
                if not await conn.send(message):
                    raise LookupError(f"device {device} went offline before the request reached it")
                return await answer
        finally:
            self._replies.pop(message.response_id, None)

    async def query_outcomes(self, device: str, calls: list[CallRef], timeout: float) -> dict[str, CallOutcome]:
        """Ask `device` what became of `calls` (OUTCOME_QUERY, report-only: the device runs nothing for it)
        and wait at most `timeout` seconds; in a cluster through the node holding it. A call without its
        `response_id` gets the one the audit log has for that call on that device, when it has one.
        Never raises: each call_id maps to its `CallOutcome`, `unknown` with a `note` saying why when the
        device is offline, did not answer in time (a device that predates the query answers nothing),
        answered with an error, or did not mention the call."""
        asked = [c if c.response_id else CallRef(call_id=c.call_id,
                                                 response_id=await self._audited_batch(device, c.call_id))
                 for c in calls]
        message = ServerMessage(type=ServerMessageType.OUTCOME_QUERY,
                                payload={"calls": [c.model_dump(exclude_none=True) for c in asked]})

        def unknown(why: str) -> dict[str, CallOutcome]:
            return {c.call_id: CallOutcome(call_id=c.call_id, state=OUTCOME_UNKNOWN, response_id=c.response_id,
                                           note=why) for c in asked}

        try:
            answer = await self.request(device, message, timeout)
        except LookupError as exc:
            return unknown(str(exc))
        except TimeoutError:
            return unknown(f"device {device} did not answer the outcome query within {timeout:g}s")
        if answer.status is TaskStatus.FAILED:
            return unknown(f"device {device} could not say: {answer.error or 'an error'}")
        known = unknown(f"device {device} did not report this call")
        for raw in (answer.payload or {}).get("outcomes") or []:
            try:
                outcome = CallOutcome.model_validate(raw)
            except ValueError:
                continue
            if outcome.call_id in known:
                known[outcome.call_id] = outcome
        return known

    async def _audited_batch(self, device: str, call_id: str) -> str | None:
        """The response_id the audit log has for `call_id` on `device`; None when it has none or cannot say."""
        try:
            return await self.store.audit.read_response_of(device, call_id)
        except Exception as exc:  # the store is unavailable: the device may still know the call_id alone
            logger.warning("could not read the batch of call %s from the audit log: %s", call_id, exc)
            return None

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
        egress = self._questions.egress(device, question)
        if batch.remote is not None and self.remote is not None:  # asked on the node holding the device
            answered = await self.remote.answer_question(device, question, action, content, by, answerer)
            self._questions.forget(device, question)
            if answered:
                self._audit_egress(device, egress, action, content, by, response_id)
            return answered
        if conn is None or not conn.ready:
            raise LookupError(f"device {device} is offline")
        frame = ServerMessage(type=ServerMessageType.ELICITATION_ANSWER, response_id=response_id,
                              status=TaskStatus.OK, payload={"id": question, "action": action, "content": content})
        if not await conn.send(frame):
            raise LookupError(f"device {device} went offline before the answer reached it")
        self._questions.forget(device, question)
        if self.notifier is not None:
            self.notifier.changes.bump()
        logger.info("question %s of device %s (batch %s) answered by %s: %s", question, device, response_id, by,
                    action)
        self._audit_egress(device, egress, action, content, by, response_id)
        return True

    def _audit_egress(self, device: str, egress: dict[str, Any] | None, action: str, content: dict[str, Any] | None,
                      by: str, response_id: str) -> None:
        """A person's answer to `ask: on-miss` is audited with who gave it; `always` is a change of the device's
        network policy (the device adds the exact host:port to its allow list), recorded as `network.allow`."""
        if egress is None:
            return
        choice = str((content or {}).get("answer")) if action == "accept" else "deny"
        self.store.audit.record(by, device, None, "network.allow" if choice == "always" else "network.ask",
                                {**egress, "answer": choice}, "success", None, response_id=response_id)

    async def revoke_token(self, id_or_name: str) -> int:
        """Revoke tokens (see `Tokens.revoke`) and disconnect their devices at once. Revocations
        made elsewhere (`tether token revoke` on the same database) are found by the liveness watch.
        The statements run without holding up the event loop (`Store.call`)."""
        count = await self.store.call(self.store.tokens.revoke, id_or_name)
        if count:
            await self._enforce_revocations()
        return count

    async def enforce_revocations(self) -> None:
        """Disconnect now the devices whose token was revoked (by a pairing that replaced them, or
        elsewhere) instead of at the liveness watch's next look."""
        await self._enforce_revocations()

    async def _enforce_revocations(self) -> None:
        active = await self.store.call(self.store.tokens.active_ids)
        for conn in [c for c in self._conns.values() if c.token_id not in active]:
            self._drop(conn, "its token was revoked", grace=False)
            self._batches.fail_device(conn.name, f"the token of device {conn.name} was revoked")
            self._close_conn(conn, CloseCode.UNAUTHORIZED, "unauthorized: token revoked")

    # -- one connection --------------------------------------------------------------------------

    async def serve(self, socket: AIPSocket, authorization: str | None, peer: str | None = None,
                    challenge: str | None = None) -> None:
        """Run one device connection from registration to cleanup. Never raises for what a device does.
        `challenge` is the one this connection was given (`protocol.identity`): the registration must
        prove the device's key with it (`registration.prove_key`)."""
        conn: DeviceLink | None = None
        if self._closed:
            await close_socket(socket, CloseCode.GOING_AWAY, "server shutting down")
            return
        try:
            conn = await self._register(socket, authorization, peer, challenge)
            if conn is not None:
                await self._receive_loop(conn)
        except Exception:
            logger.exception("device connection from %s failed", peer)
        finally:
            if conn is not None:
                self._drop(conn, "disconnected")
                if conn.closer is not None:  # let the close code reach the device before the socket goes
                    await asyncio.wait([conn.closer])

    async def _register(self, socket: AIPSocket, authorization: str | None, peer: str | None,
                        challenge: str | None = None) -> DeviceLink | None:
        """Register a connection. A device whose grace period ends while its (authenticated) registration
        is under way is not given up: it came back in time, the end of its grace waits for the outcome."""
        arriving = await self.authenticate(authorization)
        if isinstance(arriving, Refusal):
            await refuse(socket, arriving, peer)
            return None
        name = arriving.name
        self._arriving[name] = self._arriving.get(name, 0) + 1
        try:
            return await self._register_device(socket, authorization, peer, challenge)
        finally:
            self._arriving[name] -= 1
            if not self._arriving[name]:
                del self._arriving[name]
                if name in self._expired_meanwhile:
                    self._expired_meanwhile.discard(name)
                    self._grace_expired(name)

    async def _register_device(self, socket: AIPSocket, authorization: str | None,
                               peer: str | None, challenge: str | None = None) -> DeviceLink | None:
        settings = self.settings
        try:
            async with asyncio.timeout(settings.register_timeout):
                frame = await socket.receive_text()
        except TimeoutError:
            await refuse(socket, Refusal(CloseCode.BAD_REGISTRATION,
                                         f"no register frame within {settings.register_timeout:g}s"), peer)
            return None
        except SocketClosed:
            return None
        token = await self.authenticate(authorization)  # again: it may have been revoked meanwhile
        if isinstance(token, Refusal):
            await refuse(socket, token, peer)
            return None
        name = token.name
        session = ServerSession(name, settings.max_frame_bytes)  # what this connection's frames mean
        reg = session.register(frame)
        if isinstance(reg, RegistrationRefused):
            await refuse(socket, refusal_of(reg), peer)
            return None
        # a device is its key, not its token; the key's statements off the event loop (PostgreSQL)
        unproven = await self.store.call(prove_key, self.store, name, reg, challenge)
        if unproven is not None:
            await refuse(socket, unproven, peer)
            return None
        now = time.monotonic()
        old = self._conns.get(name)
        if old is not None and old.instance_id != reg.instance_id \
                and now - old.last_seen < settings.heartbeat_timeout:
            await refuse(socket, Refusal(CloseCode.DUPLICATE, (
                f"device '{name}' is already connected from {old.record.address or 'elsewhere'} (another process, "
                f"heard from {now - old.last_seen:.1f}s ago); stop it or wait {settings.heartbeat_timeout:g}s")), peer)
            return None
        record = self.registry.ensure(name)
        resumed = record.instance_id == reg.instance_id
        previous = record.instance_id or self._given_up.pop(name, None)
        if previous is not None and previous != reg.instance_id:
            self._restarted(name)
        if old is not None:  # same process reconnecting, or a stale one: the new connection wins
            self._drop(old, "replaced", grace=False)
            self._close_conn(old, CloseCode.REPLACED, "replaced by a new connection")
        if record.instance_id is not None and not resumed:
            self._batches.forget_cancels(name)
            self._batches.fail_device(name, f"device {name} restarted; outcome unknown", sent_only=True)
        self._grace.stop(name)
        self._batches.registered(name)
        conn = DeviceLink(name, socket, reg.instance_id, token.id, record, now, session=session)
        self._conns[name] = conn
        record.node = None  # held here now, whichever node held it before
        record.connected, record.profile, record.instance_id, record.address = True, reg.profile, reg.instance_id, peer
        record.connected_at = record.last_seen = time.time()
        record.running = record.queued = 0
        self._remember(name, record, record.last_seen)
        self.registry.notify()
        self._fleet_changed(name)
        if self.remote is not None:  # registered means reachable from every node: in the directory first
            await self.remote.claimed(name)
        ack = RegisterAck(device=name, heartbeat_interval=settings.heartbeat_interval,
                          heartbeat_timeout=settings.heartbeat_timeout, grace_period=settings.grace_period,
                          max_frame_bytes=settings.max_frame_bytes, resumed=resumed)
        await conn.send(ServerMessage(type=ServerMessageType.REGISTER_ACK, status=TaskStatus.OK,
                                      payload=ack.model_dump()))
        session.open()
        conn.ready = True
        logger.info("device %s registered from %s (instance %s%s)", name, peer, reg.instance_id,
                    ", resumed" if resumed else "")
        await self._router.flush(conn, resend=resumed)
        return conn

    async def authenticate(self, authorization: str | None) -> TokenInfo | Refusal:
        """The device token's info, or the refusal saying why the connection is unauthorized
        (`registration.authenticate`; the AIP endpoint applies it before the upgrade too)."""
        return await authenticate(self.store, authorization)

    async def _receive_loop(self, conn: DeviceLink) -> None:
        """Read `conn`'s frames until it closes or is dropped; its session says what each one means."""
        session = conn.session
        assert session is not None  # set when the registration was accepted
        while not conn.dropped:
            try:
                frame = await conn.socket.receive_text()
            except SocketClosed:
                return
            if conn.dropped:
                return
            conn.last_seen = time.monotonic()
            conn.record.last_seen = time.time()
            try:
                event = session.receive(frame)
                await self._handle(conn, event)
            except Exception:
                kind = session.last_type.value if session.last_type is not None else "unreadable"
                logger.exception("error handling a %s frame from device %s", kind, conn.name)
                await conn.error(f"the server failed to handle this {kind} frame", "internal")
            del frame, event  # not kept while the socket idles until its next frame (~1 KiB per device)

    async def _handle(self, conn: DeviceLink, event: SessionEvent) -> None:
        """Act on what one frame of `conn` meant (`ServerSession.receive`)."""
        if isinstance(event, ResultsArrived):
            self._batches.accept(conn.name, event.message)
        elif isinstance(event, HeartbeatArrived):
            if event.load is not None and event.load != (conn.record.running, conn.record.queued):
                conn.record.running, conn.record.queued = event.load
                self.registry.notify()
            await conn.heartbeat()
        elif isinstance(event, BadFrame):
            if event.frame_error:
                logger.warning("bad frame from device %s: %s", conn.name, event.error)
            await conn.error(event.error, event.reason)
        elif isinstance(event, EventArrived):
            batch = self._batches.pending.get(event.event.response_id or "")
            if batch is None or batch.device != conn.name or not batch.sent:
                logger.debug("dropped event %s from device %s for batch %s", event.event.kind, conn.name,
                             event.event.response_id)
                return
            self.deliver_event(batch, event.event)
        elif isinstance(event, PolicyReported | OutcomesReported):
            msg = event.message
            device, answer = self._replies.get(msg.prev_response_id or "", (None, None))
            if answer is None or device != conn.name or answer.done():
                logger.info("dropped a %s from device %s: nothing asked for it", msg.type.value, conn.name)
            else:
                answer.set_result(msg)
        elif isinstance(event, ProfileReported):
            conn.record.profile = event.profile
            assert conn.record.last_seen is not None  # set when it registered
            self._remember(conn.name, conn.record, conn.record.last_seen)
            self.registry.notify()
            self._fleet_changed(conn.name)
        elif isinstance(event, SamplingRequested):
            call_id = str((event.message.payload or {}).get("call_id") or "")
            batch = self._batches.running_call(conn.name, call_id)  # the command it says it serves, if running
            refusal = self._sampling.admit(conn.name, call_id, batch)
            job = asyncio.create_task(answer_sampling(self.sampler, conn, event.message, refusal=refusal,
                                                      caller=batch.asker if batch is not None else None,
                                                      audit=self.store.audit))
            self._tasks.add(job)
            job.add_done_callback(self._tasks.discard)
        elif isinstance(event, DeviceReportedError):
            msg = event.message
            batch = self._batches.pending.get(msg.prev_response_id or "")
            logger.warning("device %s reported an error%s: %s", conn.name,
                           f" for batch {msg.prev_response_id}" if msg.prev_response_id else "", msg.error)
            if batch is not None and batch.device == conn.name and batch.sent:
                self._batches.finish(batch, f"device {conn.name} reported: {msg.error or 'an error'}")
        else:  # REGISTER again
            await conn.error(event.error, "unexpected")

    # -- batches ---------------------------------------------------------------------------------

    @property
    def remote(self) -> RemoteDevices | None:
        """The other nodes of a cluster (a `ports.RemoteDevices`) while this server's cluster node runs:
        batches for a device held by another node go there; None on a single server."""
        return self._router.remote

    async def send_batch(self, device: str, message: ServerMessage, *,
                         on_event: Callable[[Event], None] | None = None, here_only: bool = False,
                         asker: TokenRef | None = None) -> PendingBatch:
        """`BatchRouter.send_batch`: send a COMMAND batch, queue it or hand it to the node holding `device`."""
        return await self._router.send_batch(device, message, on_event=on_event, here_only=here_only, asker=asker)

    def route(self, batch: PendingBatch, holder: str) -> None:
        """`BatchRouter.route`: let the node `holder` run `batch`."""
        self._router.route(batch, holder)

    async def adopt(self, batch: PendingBatch) -> None:
        """`BatchRouter.adopt`: a batch another node ran came back with its device, connected here."""
        await self._router.adopt(batch)

    def moved(self, device: str, holder: str) -> None:
        """`BatchRouter.moved`: another node took `device`'s socket."""
        self._router.moved(device, holder)

    def finish_remote(self, batch: PendingBatch, results: list[Any], error: str | None, *,
                      pending: bool = False) -> None:
        """`BatchRouter.finish_remote`: the holding node's answer for `batch`."""
        self._router.finish_remote(batch, results, error, pending=pending)

    def record_late(self, device: str, response_id: str, results: list[Any],
                    then: Callable[[int], None] | None = None) -> int | None:
        """`BatchRouter.record_late`: record results that came after their caller stopped waiting."""
        return self._router.record_late(device, response_id, results, then)

    def batch_device(self, response_id: str) -> str | None:
        """`BatchRouter.batch_device`: the device of a batch in flight here, or None."""
        return self._router.batch_device(response_id)

    async def cancel(self, response_id: str, reason: str = "cancelled", *, pending: bool = False) -> bool:
        """`BatchRouter.cancel`: finish the batch with `reason` and tell its device to stop."""
        return await self._router.cancel(response_id, reason, pending=pending)

    # -- liveness and disconnection --------------------------------------------------------------

    def _drop(self, conn: DeviceLink, why: str, *, grace: bool = True) -> None:
        """Forget a connection (idempotent); its device goes offline and its batches wait for grace."""
        if conn.dropped:
            return
        conn.dropped, conn.ready = True, False
        if self._conns.get(conn.name) is not conn:
            return
        del self._conns[conn.name]
        record = conn.record
        record.connected, record.running, record.queued, record.last_seen = False, 0, 0, time.time()
        self._remember(conn.name, None, record.last_seen)
        if grace and not self._closed:
            self._grace.start(conn.name, self.settings.grace_period)
        self.registry.notify()
        self._fleet_changed(conn.name)
        logger.info("device %s offline: %s", conn.name, why)
        if grace and not self._closed and self.notifier is not None:  # not a shutdown, a revocation, a takeover
            self.notifier.emit("device.offline", f"Device {conn.name} went offline ({why})",
                               {"Device": conn.name, "Platform": record.platform, "Why": why},
                               data={"device": conn.name, "why": why, "last_seen": record.last_seen},
                               devices=[(conn.name, record.tags)],
                               link=f"{server_url(self.settings) or 'http://SERVER'}/#/devices/{conn.name}")

    def _grace_expired(self, device: str) -> None:
        if device in self._conns:
            return
        if device in self._arriving:  # it is registering right now: decided when that ends
            self._expired_meanwhile.add(device)
            return
        # given up: if this device process comes back after all, it is told its batches are no longer
        # awaited (not resumed), so it stops running them instead of working for nobody
        record = self.registry.get(device)
        if record is not None:
            if record.instance_id is not None:  # a new process registering later settles what this one owed
                self._given_up[device] = record.instance_id
            record.instance_id = None
        self._batches.forget_cancels(device)
        self._batches.fail_device(device, f"device {device} disconnected and did not come back within the "
                                          f"{self.settings.grace_period:g}s grace period", pending=True)

    def _restarted(self, device: str) -> None:
        """`device` registered as a new process: the outcomes its old one left pending will never come
        (its commands were stopped with it, if they had started), so they are settled as unknown."""
        try:
            settled = self.store.audit.restarted(device)
        except Exception:
            logger.exception("could not settle the pending outcomes of restarted device %s", device)
            return
        if settled:
            logger.warning("device %s restarted: %d pending outcome(s) of its old process settled as unknown",
                           device, settled)

    def _silent(self, conn: DeviceLink, silent: float) -> None:
        self._drop(conn, f"no frame for {silent:.1f}s (timeout {self.settings.heartbeat_timeout:g}s)")
        self._close_conn(conn, CloseCode.HEARTBEAT_TIMEOUT, "heartbeat timeout")

    # -- plumbing --------------------------------------------------------------------------------

    def _remember(self, device: str, record: DeviceRecord | None, last_seen: float) -> None:
        """Store a device's last_seen, and with `record` its profile (the tool list once per digest)."""
        try:
            profile = record.profile if record is not None else None
            # behind the caller, in order (PostgreSQL: on the store's pool, the loop never waits for it)
            if record is None or profile is None or record.tools_digest is None:
                self.store.soon(self.store.devices.upsert, device, profile.model_dump_json() if profile else None,
                                last_seen)
            else:
                self.store.soon(partial(self.store.devices.upsert, device, profile.model_dump_json(exclude={"tools"}),
                                        last_seen, tools=(record.tools_digest,
                                                          self.registry.tools.dump(profile.tools))))
        except Exception:
            logger.exception("could not store device %s", device)

    def _close_conn(self, conn: DeviceLink, code: int, reason: str) -> None:
        """Close a connection's socket now, from outside its receive loop (which may be blocked)."""
        if conn.closer is None:
            conn.closer = asyncio.ensure_future(close_socket(conn.socket, code, reason))
            self._tasks.add(conn.closer)
            conn.closer.add_done_callback(self._tasks.discard)
