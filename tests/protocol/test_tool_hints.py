"""An external tool's `title` and `annotations` travel in a device's profile without breaking the other side
when it is of an earlier version: a server that does not know them validates the new profile as it always
did (its ToolInfo forbids unknown fields), and a new server reads an earlier device's profile as before."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from tether.protocol.codec import decode_client_message, encode
from tether.protocol.messages import ClientMessage, ClientMessageType, Registration
from tether.protocol.models import ToolInfo
from tether.protocol.profile import DeviceProfile

NEW = ("title", "annotations")
ANNOTATIONS = {"readOnlyHint": True, "destructiveHint": False, "idempotentHint": True, "openWorldHint": False}


def _old_models() -> tuple[type[BaseModel], type[BaseModel]]:
    """ToolInfo and DeviceProfile as a server before these fields knows them: the same fields less the new ones,
    ToolInfo still refusing unknown fields, the profile still keeping them."""
    fields: dict[str, Any] = {name: (f.annotation, f) for name, f in ToolInfo.model_fields.items() if name not in NEW}
    old_tool = create_model("OldToolInfo", __config__=ConfigDict(extra="forbid"), **fields)
    profile_fields: dict[str, Any] = {name: (f.annotation, f) for name, f in DeviceProfile.model_fields.items()
                                      if name != "tools"}
    old_profile = create_model("OldDeviceProfile", __config__=ConfigDict(extra="allow"),
                               tools=(list[old_tool], ...), **profile_fields)  # type: ignore[valid-type]
    return old_tool, old_profile


def _profile() -> DeviceProfile:
    return DeviceProfile(tools=[ToolInfo(name="run", namespace="shell", tool_type="action"),
                                ToolInfo(name="echo", namespace="everything", tool_type="data_collection",
                                         title="Echo Tool", annotations=ANNOTATIONS)])


def test_an_earlier_server_accepts_a_newer_devices_profile() -> None:
    old_tool, old_profile = _old_models()
    with pytest.raises(ValidationError):  # the guard is real: the fields inline would be refused
        old_tool.model_validate({"name": "x", "namespace": "n", "tool_type": "action", "title": "X"})
    # the frames a device sends its profile in, as device_session.py and device/link write them
    registration = Registration(instance_id="i", profile=_profile()).model_dump(mode="json")
    for payload in (registration["profile"], _profile().model_dump(mode="json")):
        wire = encode(ClientMessage(type=ClientMessageType.DEVICE_INFO, client_id="dev", payload=payload))
        sent = decode_client_message(wire).payload
        kept = old_profile.model_validate(sent)  # what the earlier server does with the frame's profile
        assert [t.name for t in kept.tools] == ["run", "echo"]  # type: ignore[attr-defined]
        back = DeviceProfile.model_validate(sent)  # and the new side reads the same frame back whole
        assert back.tools[1].hints() == {"title": "Echo Tool", "annotations": ANNOTATIONS}
        assert back.tools[0].hints() == {}


def test_a_newer_server_reads_an_earlier_devices_profile() -> None:
    _, old_profile = _old_models()
    earlier = old_profile.model_validate({"tools": [{"name": "echo", "namespace": "everything",
                                                     "tool_type": "data_collection"}]})
    read = DeviceProfile.model_validate(earlier.model_dump(mode="json"))
    assert read.tools[0].title is None and read.tools[0].annotations is None


def test_a_tools_own_dump_never_carries_them() -> None:  # the REST tool list and the live list_tools result
    tool = _profile().tools[1]
    assert not set(NEW) & tool.model_dump().keys()
    assert DeviceProfile.model_validate_json(_profile().model_dump_json()) == _profile()
