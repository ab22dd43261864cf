"""`call_spec` and `ToolContext.deadline`: a tool's own time limit is armed only when it would end
before the caller's timeout (which stops the call anyway, so a second timer would change nothing)."""

from __future__ import annotations

import asyncio

from tether.protocol.models import ResultStatus
from tether.tools.context import ToolContext
from tether.tools.policy.model import Policy
from tether.tools.runtime import call_spec, spec_of, tool


@tool("nap", tool_type="action")
async def nap(seconds: float) -> dict:
    """Sleep."""
    await asyncio.sleep(seconds)
    return {"slept": seconds}


async def test_a_tool_limit_before_the_deadline_still_fires_with_the_tools_own_message() -> None:
    loop = asyncio.get_running_loop()
    ctx = ToolContext(policy=Policy()).for_call(session_id=None, call_id="c", approved_by=None,
                                                deadline=loop.time() + 30)
    result = await call_spec(spec_of(nap), "t", {"seconds": 5}, ctx, timeout=0.05)
    assert result.status is ResultStatus.FAILURE and result.error == "nap: timed out after 0.05s " \
        "(everything it started was killed)" and result.result == {"timed_out": True, "timeout": 0.05}


async def test_the_callers_timeout_ending_first_is_the_one_that_stops_the_tool() -> None:
    loop = asyncio.get_running_loop()

    async def batch() -> None:
        async with asyncio.timeout(0.05) as scope:
            ctx = ToolContext(policy=Policy()).for_call(session_id=None, call_id="c", approved_by=None,
                                                        deadline=scope.when())
            await call_spec(spec_of(nap), "t", {"seconds": 5}, ctx, timeout=10)

    started = loop.time()
    try:
        await batch()
    except TimeoutError:
        pass
    else:
        raise AssertionError("the caller's timeout did not stop the tool")
    assert loop.time() - started < 2


async def test_for_call_keeps_the_rest_of_the_context() -> None:
    base = ToolContext(policy=Policy(), session_id="s", temp_dir="/x")
    ctx = base.for_call(session_id="t", call_id="c", approved_by="me", deadline=5.0)
    assert (ctx.policy, ctx.journal, ctx.session_id, ctx.call_id, ctx.approved_by, ctx.emit, ctx.temp_dir,
            ctx.deadline) == (base.policy, None, "t", "c", "me", base.emit, "/x", 5.0)
    assert base.for_call(session_id=None, call_id=None, approved_by=None).deadline is None
