"""`tether.tools.runtime`: a tool's argument model and JSON schemas are built when first read, not at decoration
(issue 33: a device registers without building what it does not list); what they are, and the errors, stay."""

from __future__ import annotations

from typing import Annotated, Any

import pytest
from pydantic import Field

from tether.tools.context import ToolContext
from tether.tools.runtime import ToolSet, spec_of, tool


def _built(fn: Any) -> bool:
    return "_schemas" in vars(spec_of(fn))


async def test_a_tools_schemas_are_built_once_when_first_read_and_are_what_its_signature_says() -> None:
    @tool("greet", tool_type="action", timeout=5)
    async def greet(ctx: ToolContext, name: Annotated[str, Field(description="who")], times: int = 1) -> dict:
        """Say hello.

        Longer text that is not the description."""
        return {"text": f"hello {name}" * times}

    spec = spec_of(greet)
    assert (spec.name, spec.tool_type, spec.description, spec.timeout, spec.takes_ctx) == (
        "greet", "action", "Say hello.", 5, True)
    assert not _built(greet)  # decorated, named, described: nothing built yet
    assert spec.input_schema == {"additionalProperties": False, "type": "object", "required": ["name"],
                                 "properties": {"name": {"description": "who", "type": "string"},
                                                "times": {"default": 1, "type": "integer"}}}
    assert _built(greet) and spec.params_model is spec.params_model and spec.output_schema is None
    result = await ToolSet("t", [greet]).call("greet", {"name": "x", "times": "2"}, ToolContext())
    assert result.error is not None and "argument 'times'" in result.error  # strict, as before


def test_star_arguments_are_still_refused_at_decoration() -> None:
    with pytest.raises(TypeError, match=r"\*args/\*\*kwargs are not allowed"):
        @tool("bad", tool_type="action")
        async def bad(*names: str) -> None:
            """Takes anything."""


def test_a_hint_that_names_nothing_fails_when_the_schema_is_first_read() -> None:
    @tool("broken", tool_type="action")
    async def broken(value: NoSuchType) -> None:  # type: ignore[name-defined]  # noqa: F821
        """Its hint names nothing."""

    assert spec_of(broken).name == "broken"
    with pytest.raises(NameError, match="NoSuchType"):
        assert spec_of(broken).input_schema
