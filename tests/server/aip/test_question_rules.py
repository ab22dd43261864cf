"""The rules behind who answers an external MCP server's question: which questions ask for consent
(`aip.questions.asks_consent`) and who may answer whose (`approvals.check_answerer`)."""

from __future__ import annotations

import pytest

from tether.server.aip.batches.ledger import TokenRef
from tether.server.aip.questions.asked import asks_consent
from tether.server.trust.approvals import ApprovalRefused, check_answerer


@pytest.mark.parametrize(("schema", "consent"), [
    ({"type": "object", "properties": {}}, True),  # accepting is the yes
    (None, True),  # nothing readable: treated as the stricter kind
    ({"type": "object", "properties": {"confirm": {"type": "boolean"}}}, True),
    ({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}}}, True),
    ({"type": "object", "properties": {"decision": {"type": "string", "enum": ["Approve", "deny"]}}}, True),
    ({"type": "object", "properties": {"d": {"oneOf": [{"const": "yes"}, {"const": "no"}]}}}, True),
    ({"type": "object", "properties": {"colour": {"type": "string"}}}, False),
    ({"type": "object", "properties": {"size": {"type": "string", "enum": ["small", "large"]}}}, False),
    ({"type": "object", "properties": {"ok": {"type": "boolean"}, "why": {"type": "string"}}}, False),
])
def test_which_questions_ask_for_consent(schema: object, consent: bool) -> None:
    assert asks_consent(schema) is consent


ALICE, BOB, ROBOT = TokenRef("alice"), TokenRef("bob"), TokenRef("robot", agent=True)


def answer(asker: TokenRef | None, answerer: TokenRef, *, consent: bool, four_eyes: bool) -> str | None:
    try:
        check_answerer(asker, answerer, consent=consent, four_eyes=four_eyes, what="answer q1", how="HOW")
    except ApprovalRefused as exc:
        return str(exc)
    return None


def test_a_persons_question_is_theirs() -> None:
    assert answer(ALICE, ALICE, consent=True, four_eyes=False) is None
    refused = answer(ALICE, BOB, consent=False, four_eyes=False)
    assert refused is not None and "'alice'" in refused and "'bob' may not" in refused and "HOW" in refused
    assert answer(ALICE, BOB, consent=True, four_eyes=False) is not None


def test_an_agents_question_goes_to_a_person_and_an_agent_never_answers() -> None:
    assert answer(ROBOT, BOB, consent=True, four_eyes=False) is None
    assert answer(ROBOT, BOB, consent=False, four_eyes=True) is None
    assert "agent" in (answer(ROBOT, ROBOT, consent=False, four_eyes=False) or "")
    assert "agent" in (answer(ALICE, ROBOT, consent=False, four_eyes=False) or "")
    assert "agent" in (answer(None, ROBOT, consent=False, four_eyes=False) or "")


def test_four_eyes_moves_consent_to_a_second_person() -> None:
    assert "four-eyes" in (answer(ALICE, ALICE, consent=True, four_eyes=True) or "")
    assert answer(ALICE, BOB, consent=True, four_eyes=True) is None
    assert answer(ALICE, ALICE, consent=False, four_eyes=True) is None  # information stays the caller's
    assert answer(ALICE, BOB, consent=False, four_eyes=True) is not None


def test_a_batch_without_a_recorded_caller_is_left_to_its_route() -> None:
    assert answer(None, BOB, consent=True, four_eyes=True) is None
