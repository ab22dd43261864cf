"""`new_call_id`: what `uuid.uuid4().hex` gives, made more cheaply (one per command and per batch)."""

from __future__ import annotations

import uuid

from tether.protocol.models import new_call_id


def test_new_call_id_is_a_random_uuid4_in_hex() -> None:
    ids = {new_call_id() for _ in range(2000)}
    assert len(ids) == 2000
    for value in ids:
        parsed = uuid.UUID(value)
        assert parsed.hex == value and parsed.version == 4 and parsed.variant == uuid.RFC_4122
