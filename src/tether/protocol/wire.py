"""AIP's wire constants, defined once for both sides: the WebSocket close codes and the frames that are
written by hand (the server's heartbeat reply) instead of through a model.

The frame kinds themselves are `messages.ServerMessageType` and `messages.ClientMessageType`; a frame a side
writes by hand takes its kind from there too.
"""

from __future__ import annotations

from enum import IntEnum

from tether.protocol.messages import PROTOCOL_VERSION, ServerMessageType

__all__ = ["SERVER_HEARTBEAT", "CloseCode"]


class CloseCode(IntEnum):
    """The close codes of an AIP socket. The server closes with them; the device reads them to decide
    whether to reconnect (`device.reconnect.FATAL_CLOSE_CODES` end its run, the others are retried)."""

    GOING_AWAY = 1001  # the server shuts down
    REPLACED = 4000  # a newer connection of the same device took over
    HEARTBEAT_TIMEOUT = 4001  # the device fell silent; it may reconnect
    BAD_REGISTRATION = 4400  # first frame not a valid REGISTER, wrong protocol version, no frame in time
    UNAUTHORIZED = 4401  # missing, unknown or revoked token, or not a device token
    KEY_REFUSED = 4402  # no proof of the device's key, or a key other than the one enrolled for it
    WRONG_DEVICE = 4403  # the registration claims another device than the token's
    DUPLICATE = 4409  # another live process of this device is connected


# The server's heartbeat reply as the server writes it, `%` formatted with (timestamp, response_id); the device
# recognises it without building a model (`codec.is_server_heartbeat`). Both fields are plain strings: an ISO
# timestamp and a hex id, nothing that JSON would escape.
SERVER_HEARTBEAT = ('{"protocol_version":"' + PROTOCOL_VERSION + '","timestamp":"%s","type":"'
                    + ServerMessageType.HEARTBEAT.value + '","status":"ok","response_id":"%s","early_exit":true}')
