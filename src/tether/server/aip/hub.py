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
`tether.server.aip.sockets.socket.aip_route` adapts a Starlette WebSocket to it. What each frame means is
judged by the connection's sans-I/O session (`tether.protocol.server_session`); the hub keeps the table of
connections and acts on those judgements. Where each batch goes and the ledger of batches in flight
(`tether.server.aip.batches.router`, `tether.server.aip.batches.ledger`), the liveness timers
(`tether.server.aip.fleet.liveness`), the writes to one socket (`tether.server.aip.sockets.link`), the judgement of a
registration (`tether.server.aip.sockets.registration`) and what external MCP servers ask through a device
(`tether.server.aip.questions.asked`) each live in their own module; the hub is where they meet. The hub itself is
split by job: admission (`sockets.admission`), frames (`sockets.frames`), questions (`questions.answering`),
batches (`batches.routing`), departures (`fleet.departures`), over the attributes they share (`hub_state`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tether.protocol.messages import (
    OUTCOME_UNKNOWN,
    CallOutcome,
    CallRef,
    ClientMessage,
    Event,
    ServerMessage,
    ServerMessageType,
    TaskStatus,
)
from tether.protocol.wire import CloseCode
from tether.server.aip.batches.dispatcher import WebSocketCommandDispatcher
from tether.server.aip.batches.ledger import PendingBatch, TokenRef
from tether.server.aip.batches.router import BatchRouter
from tether.server.aip.batches.routing import HubBatches
from tether.server.aip.fleet.departures import HubLiveness
from tether.server.aip.fleet.gc_keeper import keep_gc_lean
from tether.server.aip.fleet.liveness import GracePeriods, watch_liveness
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.questions.answering import HubQuestions
from tether.server.aip.questions.asked import OpenQuestions, Sampler, SamplingGate
from tether.server.aip.sockets.admission import HubAdmission
from tether.server.aip.sockets.frames import HubFrames
from tether.server.aip.sockets.link import DeviceLink
from tether.server.ports import BackplaneUnavailable, RemoteSlot
from tether.server.settings import ServerSettings
from tether.server.store import Store

if TYPE_CHECKING:
    from tether.protocol.models import Command
    from tether.protocol.profile import DeviceRequirements
    from tether.server.aip.batches.fanout import DeviceOutcome
    from tether.server.aip.desktop_holds import DesktopHolds
    from tether.server.notify.notifier import Notifier

PRELOAD_AFTER_S = 2.0  # known devices' stored profiles are read this long after start, in the background


logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name


class DeviceHub(HubAdmission, HubFrames, HubQuestions, HubBatches, HubLiveness):
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
        """Run `commands` on every device meeting `requires` (server/aip/batches/fanout.py) and return
        `{"devices": [lines…], "summary": {…}}`: how a layer above (a task step `on: all`) fans out
        without importing the server's modules. `FanOutError` (a ValueError) when it cannot start."""
        from tether.server.aip.batches.fanout import countable, run_fan_out

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
