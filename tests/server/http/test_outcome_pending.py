"""How an "outcome pending" answer reads (docs/outcomes.md): machine-readable, not a failure, naming
where its outcome will be — for a program, the CLI and an MCP client."""

from __future__ import annotations

from tether.protocol.models import Result, ResultStatus
from tether.server.mcp.tools.tool_call import result_reply


def test_a_pending_result_says_where_to_look() -> None:
    result = Result.pending("timed out after 5s", "c1", "b" * 32, "laptop")
    assert result.status is ResultStatus.NONE and result.outcome_pending and not result.ok
    assert result.error is not None and result.error.startswith("outcome pending: timed out after 5s")
    assert f"tether batch {'b' * 32}" in result.error and "laptop" in result.error
    assert result.result == {"outcome": "pending", "batch_id": "b" * 32, "call_id": "c1", "device": "laptop",
                             "reason": "timed out after 5s"}
    again = Result.model_validate_json(result.model_dump_json())  # as a REST caller reads it
    assert again.outcome_pending
    assert not Result.failure("boom", "c1").outcome_pending
    assert not Result(status=ResultStatus.NONE, call_id="c1").outcome_pending


def test_an_mcp_client_reads_pending_not_an_error() -> None:
    """An agent told "error" retries, and a retry may run the command twice: pending is no error."""
    reply = result_reply(Result.pending("timed out after 5s", "c1", "b" * 32, "laptop"))
    assert not reply.is_error and reply.text.startswith("outcome pending:")
    assert reply.payload["outcome"] == "pending"
    assert result_reply(Result.failure("boom", "c1")).is_error
