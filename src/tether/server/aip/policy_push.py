"""Showing and changing a device's policy from the server (`tether policy`): POLICY_REQUEST and
POLICY_SET over AIP, answered by the device's POLICY_REPORT.

Every change is audited (tool name `policy.set`, the change as its arguments, `success` with the
device's new policy version or `failure` with its reason), whether the device took it or not. Whether a
change is allowed is the device's to say (`policy_remote`), so a refusal comes back from it in words.
"""

from __future__ import annotations

from typing import Any

from tether.errors import ServerError
from tether.protocol.messages import ServerMessage, ServerMessageType, TaskStatus
from tether.server.aip.hub import DeviceHub
from tether.server.store.audit import AuditLog

POLICY_TIMEOUT_S = 15.0  # a device answers from memory and one small file write


class PolicyRequestFailed(ServerError):
    """The device was not reachable or did not answer (`status` 409: the device's state, not the
    server's fault) or refused the request (`status` 422)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


async def show(hub: DeviceHub, device: str, timeout: float = POLICY_TIMEOUT_S) -> dict[str, Any]:
    """The device's effective policy, where each value comes from, and its policy version."""
    return await _ask(hub, device, ServerMessage(type=ServerMessageType.POLICY_REQUEST), timeout)


async def change(hub: DeviceHub, device: str, policy: dict[str, Any], *, replace: bool, requested_by: str,
                 audit: AuditLog, timeout: float = POLICY_TIMEOUT_S) -> dict[str, Any]:
    """Push a change (an overlay: settings, and `commands` entries with null to remove a program) and
    return the device's report of its new policy; recorded in `audit` either way. Raises
    `PolicyRequestFailed` when the device was not reached, did not answer or refused the change."""
    message = ServerMessage(type=ServerMessageType.POLICY_SET, payload={"policy": policy, "replace": replace})
    arguments = {"policy": policy, "replace": replace}
    try:
        report = await _ask(hub, device, message, timeout)
    except PolicyRequestFailed as exc:
        audit.record(requested_by, device, None, "policy.set", arguments, "failure", str(exc),
                     response_id=message.response_id)
        raise
    audit.record(requested_by, device, None, "policy.set", {**arguments, "version": report.get("version")},
                 "success", None, response_id=message.response_id)
    return report


async def _ask(hub: DeviceHub, device: str, message: ServerMessage, timeout: float) -> dict[str, Any]:
    try:
        answer = await hub.request(device, message, timeout)
    except LookupError as exc:
        raise PolicyRequestFailed(str(exc), 409) from None
    except TimeoutError:
        raise PolicyRequestFailed(f"device {device} did not answer within {timeout:g}s", 409) from None
    if answer.status is TaskStatus.FAILED or not isinstance(answer.payload, dict):
        raise PolicyRequestFailed(f"device {device}: {answer.error or 'no policy in its answer'}", 422)
    return answer.payload
