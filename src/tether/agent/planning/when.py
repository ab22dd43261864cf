"""When a step of a graph plan runs: after its needs succeeded (`success`, the default), after one of them
failed (`failure`), whatever they did (`always`), or when a condition on an earlier result holds.

A condition is data, never code: `{"ref": "steps.ID.result.KEY", "equals" | "contains" | "matches": VALUE}`
(with `"negate": true` to invert it). `ref` is a reference as in arguments (`tether.agent.planning.refs`);
`equals` compares the value as JSON, `contains` looks for a text in a string (or an item in a list),
`matches` searches a regular expression (at most `MAX_PATTERN` characters, over at most `MAX_SUBJECT`
characters of the value's text). A reference that does not resolve makes the condition false.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tether.agent.planning.refs import REF_PATTERN, RefError, lookup, parse_ref

MAX_PATTERN = 200
MAX_SUBJECT = 100_000
_TESTS = ("equals", "contains", "matches")

WhenWord = Literal["success", "failure", "always"]


class Condition(BaseModel):
    """A test on an earlier step's result; exactly one of `equals`, `contains`, `matches`."""

    # the schema says what the validator checks, so a client (and a schema fuzzer) can tell a condition the
    # server takes: exactly one test given and not null, a reference's shape, a pattern that compiles
    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": [test], "properties": {test: {"not": {"type": "null"}},
                                            **{other: {"type": "null"} for other in _TESTS if other != test}}}
        for test in ("equals", "contains", "matches")]})

    ref: str = Field(..., min_length=1, json_schema_extra={"pattern": REF_PATTERN},  # checked below, in words
                     description='what to test, e.g. "steps.build.result.exitCode"')
    equals: Any = Field(default=None, description="true when the value equals this (as JSON)")
    contains: Any = Field(default=None, description="true when the text (or list) contains this")
    matches: str | None = Field(default=None, max_length=MAX_PATTERN, json_schema_extra={"format": "regex"},
                                description="a regular expression searched in the value's text")
    negate: bool = Field(default=False, description="true inverts the test")

    @model_validator(mode="after")
    def _one_test(self) -> Condition:
        given = [k for k in ("equals", "contains", "matches") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a condition has exactly one of equals, contains, matches (it has "
                             f"{', '.join(given) or 'none'})")
        if self.matches is not None:
            try:
                re.compile(self.matches)
            except re.error as exc:
                raise ValueError(f"matches: not a regular expression: {exc}") from None
        try:
            parse_ref(self.ref, _AnyId())
        except RefError as exc:
            raise ValueError(f"ref: {exc}") from None
        return self

    def target(self, ids: Mapping[str, int]) -> int:
        """The step number (from 1) the condition reads; `RefError` when it names no step."""
        return parse_ref(self.ref, ids)[0]

    def holds(self, results: Mapping[int, Any], ids: Mapping[str, int]) -> tuple[bool, str]:
        """(whether it holds, why) given each finished step's result by number (from 1)."""
        try:
            number, parts = parse_ref(self.ref, ids)
            if number not in results:
                raise RefError(f"step {number} has no result")
            value = lookup(results[number], parts)
        except RefError as exc:
            return False, f"{self.ref} does not resolve ({exc})"
        if self.equals is not None:
            ok, test = value == self.equals, f"equals {json.dumps(self.equals, default=str)}"
        elif self.contains is not None:
            ok = self.contains in value if isinstance(value, list) else str(self.contains) in _text(value)
            test = f"contains {json.dumps(self.contains, default=str)}"
        else:
            assert self.matches is not None
            ok, test = re.search(self.matches, _text(value)[:MAX_SUBJECT]) is not None, f"matches {self.matches!r}"
        ok = ok != self.negate
        return ok, f"{self.ref} {'does not ' if self.negate else ''}{test}: {'yes' if ok else 'no'}"


class _AnyId(dict[str, int]):
    """Accepts every id (a condition is checked against the plan's real ids later)."""

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: str) -> int:
        return 0


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


When = WhenWord | Condition
