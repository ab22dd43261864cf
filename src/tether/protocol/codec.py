"""Frames to messages and back, with the checks every frame gets before anyone acts on it.

Pure functions over text (sans-I/O): the server's and the device's socket layers both call them,
so a frame that is too large, not JSON, of another protocol version or of the wrong shape is
refused the same way on both sides, with an error a person can act on.
"""

from __future__ import annotations

import re
import uuid
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from tether.errors import ProtocolError
from tether.protocol.messages import PROTOCOL_VERSION, ClientMessage, ClientMessageType, ServerMessage, utc_now
from tether.protocol.wire import SERVER_HEARTBEAT

DEFAULT_MAX_FRAME_BYTES = 8 * 1024 * 1024

M = TypeVar("M", bound=BaseModel)


class FrameError(ProtocolError, ValueError):
    """A frame that cannot be accepted; `reason` is a short machine-readable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def major(version: str) -> str:
    return version.split(".", 1)[0]


def _decode(model: type[M], frame: str | bytes, max_bytes: int) -> M:
    size = len(frame) if isinstance(frame, bytes) or frame.isascii() else len(frame.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise FrameError("too_large", f"frame of {size} bytes exceeds the limit of {max_bytes} bytes")
    if _non_json_numbers(frame):
        raise FrameError("not_json", "frame is not valid JSON (NaN and Infinity are not JSON numbers)")
    try:
        message = model.model_validate_json(frame)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if any(e["type"] == "json_invalid" for e in errors):
            raise FrameError("not_json", "frame is not valid JSON") from None
        _check_version_of_raw(frame)
        detail = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'frame'}: {e['msg']}" for e in errors[:5])
        raise FrameError("invalid", f"invalid {model.__name__}: {detail}") from None
    version = getattr(message, "protocol_version", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION and major(version) != major(PROTOCOL_VERSION):
        raise FrameError("version", f"protocol version {version} is not supported (this side speaks "
                                    f"{PROTOCOL_VERSION})")
    return message


def _non_json_numbers(frame: str | bytes) -> bool:
    """Whether the frame uses NaN or Infinity, which pydantic's parser takes in untyped fields (a payload,
    a result) although they are not JSON: the value would silently become null when passed on. Only a
    frame that has those words anywhere is parsed strictly, so the common frame pays two substring scans."""
    if isinstance(frame, bytes):
        suspicious = b"NaN" in frame or b"Infinity" in frame
    else:
        suspicious = "NaN" in frame or "Infinity" in frame
    if not suspicious:
        return False
    try:
        from_json(frame, allow_inf_nan=False)
    except ValueError:
        return True
    return False


def _check_version_of_raw(frame: str | bytes) -> None:
    """A frame of another major version usually fails validation first; say the real reason."""
    import json

    try:
        version = json.loads(frame).get("protocol_version")
    except (ValueError, AttributeError):
        return
    if isinstance(version, str) and major(version) != major(PROTOCOL_VERSION):
        raise FrameError("version", f"protocol version {version} is not supported (this side speaks "
                                    f"{PROTOCOL_VERSION})")


def decode_client_message(frame: str | bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> ClientMessage:
    return _decode(ClientMessage, frame, max_bytes)


def decode_server_message(frame: str | bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> ServerMessage:
    return _decode(ServerMessage, frame, max_bytes)


def encode(message: BaseModel) -> str:
    return message.model_dump_json(exclude_none=True)


# The server's heartbeat reply, exactly as the server writes it (`wire.SERVER_HEARTBEAT`): a
# device gets one per heartbeat and does nothing with it but note that the link lives, so it need not
# build a model for it. Strings without escapes or control characters only (the template's are a
# timestamp and a hex id): whatever matches is valid JSON and a valid ServerMessage of this protocol
# version, which the full decoder would accept too. Anything else goes through the full decoder.
_JSON_PLAIN = r'[^"\\\x00-\x1f]*'  # a JSON string's characters, no escapes
_SERVER_HEARTBEAT = re.compile(re.escape(SERVER_HEARTBEAT).replace("%s", _JSON_PLAIN))
_SERVER_HEARTBEAT_MAX = 512  # the template's frames are ~150 bytes


def is_server_heartbeat(frame: str | bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bool:
    """Whether `frame` is the server's plain heartbeat reply (no model built); False means: decode it."""
    return (isinstance(frame, str) and len(frame) <= min(max_bytes, _SERVER_HEARTBEAT_MAX) and frame.isascii()
            and _SERVER_HEARTBEAT.fullmatch(frame) is not None)


class HeartbeatFrame:
    """A device's HEARTBEAT frame for one client_id, written from a template: the text `encode` gives for
    `ClientMessage(type=HEARTBEAT, client_id=…, payload={"running": r, "queued": q})` with a fresh
    timestamp, without a model per beat. The template is cut from the encoder's own output once (so the
    client_id is escaped exactly as `encode` escapes it); should that ever fail, every beat is encoded."""

    def __init__(self, client_id: str | None) -> None:
        self.client_id = client_id
        mark = uuid.uuid4().hex
        stamp, running, queued = f"T{mark}", 7_000_000_000_000_000_001, 7_000_000_000_000_000_002
        probe = encode(ClientMessage(type=ClientMessageType.HEARTBEAT, client_id=client_id, timestamp=stamp,
                                     payload={"running": running, "queued": queued}))
        self._parts: tuple[str, ...] | None = None
        parts, rest = [], probe
        for mark in (stamp, str(running), str(queued)):  # each exactly once, in this order
            before, *after = rest.split(mark)
            if len(after) != 1:
                return
            parts.append(before)
            rest = after[0]
        self._parts = (*parts, rest)

    def __call__(self, running: int, queued: int) -> str:
        parts = self._parts
        if parts is None:
            return encode(ClientMessage(type=ClientMessageType.HEARTBEAT, client_id=self.client_id,
                                        payload={"running": running, "queued": queued}))
        return f"{parts[0]}{utc_now()}{parts[1]}{running}{parts[2]}{queued}{parts[3]}"
