"""Assertions on tool results shared by the tool tests: success gives the payload, failure the error."""

from __future__ import annotations

from typing import Any

from tether.protocol.models import Result


def ok(result: Result) -> dict[str, Any]:
    assert result.ok, result.error
    return result.result


def failed(result: Result, *fragments: str) -> str:
    assert not result.ok, result.result
    assert result.error is not None
    for fragment in fragments:
        assert fragment in result.error, result.error
    return result.error
