"""What the device owes the server: frames waiting for the socket.

Results are the one thing a device must never lose, so they live in an ordered queue that survives
a disconnect (the *outbox*) and is delivered first after the next registration. Events (streamed
output, progress) are only useful while someone watches: their queue is bounded and drops its
oldest entries when the link is slower than the tool, counting what it dropped and telling the
server so once the queue has drained. Control frames (heartbeats, errors, device info) belong to
one connection and are discarded with it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Literal

from pydantic_core import PydanticSerializationError, to_json

from tether.protocol.codec import encode
from tether.protocol.messages import (
    PROTOCOL_VERSION,
    ClientMessage,
    ClientMessageType,
    Event,
    ServerMessage,
    TaskStatus,
    utc_now,
)
from tether.protocol.models import Result

logger = logging.getLogger(__name__)

FrameKind = Literal["result", "event", "control", "beat"]
Frame = tuple[FrameKind, str, str | None]  # kind, encoded text, call_id (results only)


def frame_bytes(text: str) -> int:
    """UTF-8 size of `text`, without encoding it when it is clearly small (the hot path)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def results_frame(msg: ServerMessage, result: Result, *, last: bool, client_id: str | None,
                  max_bytes: int) -> str:
    """One COMMAND_RESULTS frame for one result; a result too large for a frame becomes a failure
    that says so (the server must learn the command ended, and why it cannot see the output)."""
    status = TaskStatus.COMPLETED if last else TaskStatus.CONTINUE

    def build(r: Result) -> str:
        return encode(ClientMessage(type=ClientMessageType.COMMAND_RESULTS, client_id=client_id,
                                    session_id=msg.session_id, prev_response_id=msg.response_id,
                                    action_results=[r], status=status))

    # an empty response_id makes the message invalid: the model says so
    try:
        text = _results_text(msg, result, status, client_id) if msg.response_id else build(result)
    except PydanticSerializationError as exc:
        # a value JSON cannot carry (text holding bytes that are not UTF-8): say so at once, or the caller
        # waits for a result that never comes and sees only its own timeout
        why = str(exc).encode("ascii", "backslashreplace").decode("ascii")
        logger.warning("result of %s could not be encoded: %s", result.call_id, why)
        return build(Result.failure(f"the tool ran but its result could not be encoded as JSON ({why[:300]})",
                                    result.call_id, result.namespace,
                                    {"unencodable": True, "status": result.status.value}))
    size = frame_bytes(text)
    if size <= max_bytes:
        return text
    logger.warning("result of %s is %d bytes, over the frame limit of %d: sent as a failure",
                   result.call_id, size, max_bytes)
    return build(Result.failure(
        f"the result was too large to send ({size} bytes; the frame limit is {max_bytes} bytes): "
        f"ask for less output (e.g. a narrower command, or write it to a file and read parts of it)",
        result.call_id, result.namespace,
        {"too_large": True, "bytes": size, "limit": max_bytes, "status": result.status.value}))


def _json_str(value: str) -> str:
    return to_json(value).decode()


_RESULTS_HEAD = f'{{"protocol_version":{_json_str(PROTOCOL_VERSION)},"timestamp":"'
_RESULTS_KIND = f'","type":"{ClientMessageType.COMMAND_RESULTS.value}","status":"'


def _results_text(msg: ServerMessage, result: Result, status: TaskStatus, client_id: str | None) -> str:
    """What `build` in `results_frame` encodes, character for character (a test compares them),
    written directly: building and validating the message would check nothing that is not already
    known (our own `Result`, the ids of a COMMAND that was validated on arrival) and cost twice as
    much on every round trip."""
    text = f'{_RESULTS_HEAD}{utc_now()}{_RESULTS_KIND}{status.value}"'
    if client_id is not None:
        text += f',"client_id":{_json_str(client_id)}'
    if msg.session_id is not None:
        text += f',"session_id":{_json_str(msg.session_id)}'
    return (f'{text},"prev_response_id":{_json_str(msg.response_id)},"action_results":['
            f'{result.model_dump_json(exclude_none=True)}]}}')


# results written but not yet acknowledged, kept to be sent again after a reconnect: at most this many, and
# this many bytes (past either, the oldest go: a resend within the grace period still finds them in the
# device's record of finished calls)
MAX_UNACKED = 10_000
MAX_UNACKED_BYTES = 64 * 1024 * 1024


class Outbox:
    """Frames waiting for a socket, in the order they were produced (control frames go first).

    `accepting_events` is on only while a connection is registered: output produced while
    disconnected is stale by the time anyone could see it, whereas its result is not.

    A result leaves the outbox when the server has it, not when it was written: a frame written into
    a link that then dies is lost with it. So a written result is kept (`unacked`) until the server
    answers a heartbeat the device wrote after it — the server handles a device's frames in order and
    answers only heartbeats, so that answer says every frame before the heartbeat was taken. After a
    reconnect the results not acknowledged go out again, first (the server records a result it
    already has once: `BatchBook.accept`, `AuditLog.late`). A heartbeat is due while results wait
    for their acknowledgement (`unacked`).
    """

    def __init__(self, max_events: int = 1000) -> None:
        self.max_events = max_events
        self._results: deque[tuple[int, str, str | None]] = deque()
        self._events: deque[tuple[int, ClientMessage]] = deque()
        self._control: deque[str] = deque()
        self._seq = itertools.count()
        self._popped_seq = -1  # the sequence number of the result `pop` returned last
        self.accepting_events = False
        self.dropped_events = 0
        self._unreported_drops = 0
        self.max_bytes = 8 * 1024 * 1024
        self.ready = asyncio.Event()  # something to send
        self.idle = asyncio.Event()  # nothing left to send and the last frame was written
        self.idle.set()
        # set by the connection while its sender sleeps: writes a frame to the socket at once and
        # returns True, or False when it cannot (the frame is then queued as usual)
        self.write_now: Callable[[str], bool] | None = None
        self.puts = 0  # frames put for sending, ever: the heartbeat asks whether any went since its last beat
        # results written and not yet acknowledged, by sequence number (written order), and for each
        # heartbeat written since, the last sequence number written before it (what its answer acknowledges)
        self._unacked: OrderedDict[int, tuple[str, str | None]] = OrderedDict()
        self._beats: deque[int] = deque()
        self._written = -1  # the sequence number of the last result written
        self._unacked_bytes = 0

    def __len__(self) -> int:
        return len(self._results) + len(self._events) + len(self._control)

    @property
    def pending_results(self) -> int:
        """Results the server may not have yet: waiting to be written, or written and not acknowledged."""
        return len(self._results) + len(self._unacked)

    def pending_call_ids(self) -> list[str]:
        """The call_ids whose results wait here, in delivery order (a registration lists them)."""
        return [call_id for _, call_id in self._unacked.values() if call_id] + \
            [call_id for _, _, call_id in self._results if call_id]

    def _wake(self) -> None:
        self.idle.clear()
        self.ready.set()

    @property
    def unacked(self) -> int:
        """Results written to the server and not yet acknowledged (kept to be sent again)."""
        return len(self._unacked)

    def put_result(self, text: str, call_id: str | None) -> None:
        # the hot path: nothing waiting and the sender asleep, so the frame goes out from here,
        # without waking the sender task (one event-loop hop per result)
        self.puts += 1
        seq = next(self._seq)
        if self.write_now is not None and not (self._results or self._events or self._control) \
                and self.write_now(text):
            self._wrote_result(seq, text, call_id)
            return
        self._results.append((seq, text, call_id))
        self._wake()

    def put_heartbeat(self, text: str) -> None:
        """A heartbeat: a control frame whose answer acknowledges the results written before it."""
        if not self.accepting_events:
            return
        self.puts += 1
        if self.write_now is not None and not (self._results or self._events or self._control) \
                and self.write_now(text):
            self._beats.append(self._written)
            return
        self._control.append("\0beat" + text)
        self._wake()

    def written(self, frame: Frame, seq: int | None = None) -> None:
        """The sender wrote `frame` (from `pop`) to the socket: a result now waits for its acknowledgement."""
        kind, text, call_id = frame
        if kind == "result":
            self._wrote_result(self._popped_seq if seq is None else seq, text, call_id)
        elif kind == "beat":
            self._beats.append(self._written)

    def _wrote_result(self, seq: int, text: str, call_id: str | None) -> None:
        self._unacked[seq] = (text, call_id)
        self._unacked_bytes += len(text)
        self._written = max(self._written, seq)
        # a server that never answers heartbeats, or huge results: keep the newest
        while len(self._unacked) > MAX_UNACKED or (self._unacked_bytes > MAX_UNACKED_BYTES and len(self._unacked) > 1):
            _, (old, _) = self._unacked.popitem(last=False)
            self._unacked_bytes -= len(old)

    def heartbeat_answered(self) -> None:
        """The server answered a heartbeat: the results written before the oldest one unanswered are its."""
        if not self._beats:
            return
        upto = self._beats.popleft()
        while self._unacked:
            seq = next(iter(self._unacked))
            if seq > upto:
                break
            self._unacked_bytes -= len(self._unacked.pop(seq)[0])

    def put_control(self, text: str) -> None:
        if self.accepting_events:
            self.puts += 1
            # as for a result: nothing waiting and the sender asleep (an idle device's heartbeat), written
            # from here without waking the sender
            if self.write_now is not None and not (self._results or self._events or self._control) \
                    and self.write_now(text):
                return
            self._control.append(text)
            self._wake()

    def put_event(self, event: ClientMessage) -> None:
        """Queue an event (encoded only when sent); when full, the oldest event makes room."""
        if not self.accepting_events:
            self.dropped_events += 1
            return
        if len(self._events) >= self.max_events:
            self._events.popleft()
            self.dropped_events += 1
            self._unreported_drops += 1
        self._events.append((next(self._seq), event))
        self.puts += 1
        self._wake()

    def pop(self) -> Frame | None:
        """The next frame to write: control first, then results and events in production order."""
        if self._control:
            text = self._control.popleft()
            if text.startswith("\0beat"):
                return "beat", text[5:], None
            return "control", text, None
        while self._results or self._events:
            if self._results and (not self._events or self._results[0][0] < self._events[0][0]):
                self._popped_seq, text, call_id = self._results.popleft()
                return "result", text, call_id
            _, event = self._events.popleft()
            encoded = self._encode_event(event)
            if encoded is not None:
                return "event", encoded, None
        if self._unreported_drops and self.accepting_events:
            count, self._unreported_drops = self._unreported_drops, 0
            note = Event(kind="events_dropped", data={"count": count, "total": self.dropped_events})
            return "event", encode(ClientMessage(type=ClientMessageType.EVENT, payload=note.model_dump())), None
        return None

    def _encode_event(self, event: ClientMessage) -> str | None:
        try:
            text = encode(event)
        except (TypeError, ValueError) as exc:  # a tool emitted data that is not JSON
            logger.warning("dropping an event that cannot be encoded: %s", exc)
            return None
        if frame_bytes(text) > self.max_bytes:
            logger.warning("dropping an event of %d bytes (frame limit %d)", frame_bytes(text), self.max_bytes)
            self.dropped_events += 1
            return None
        return text

    def push_back(self, frame: Frame) -> None:
        """A result the socket did not take goes back to the head of the outbox."""
        kind, text, call_id = frame
        if kind == "result":
            self._results.appendleft((self._popped_seq, text, call_id))
            self._wake()

    def wait_state(self) -> None:
        """Nothing to send: the sender sleeps on `ready`, and `idle` tells a flush it is done."""
        self.ready.clear()
        self.idle.set()

    def open(self, max_bytes: int) -> None:
        """A new connection is registered: the results not acknowledged on the last one go out first."""
        self.max_bytes = max_bytes
        self.accepting_events = True
        if self._unacked:
            self._results.extendleft((seq, text, call_id) for seq, (text, call_id) in reversed(self._unacked.items()))
            self._unacked.clear()
            self._unacked_bytes = 0
        if self._results:
            self._wake()

    def close(self) -> None:
        """The connection is gone: its events and control frames go with it, results stay."""
        self.accepting_events = False
        self.dropped_events += len(self._events)
        self._events.clear()
        self._control.clear()
        self._beats.clear()  # their answers will never come
        self._written = -1  # on the next connection nothing counts as written until it goes out again
        self._unreported_drops = 0
        if not self._results:
            self.ready.clear()
            self.idle.set()
