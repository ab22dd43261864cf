"""`run_in_this_task`: how the device's reader runs a batch itself, and hands over when the batch waits."""

from __future__ import annotations

import asyncio

from tether.device.link.run_here import run_in_this_task


async def test_a_batch_that_does_not_wait_runs_to_its_end_in_the_callers_task() -> None:
    me = asyncio.current_task()
    seen: list[object] = []

    async def batch() -> None:
        seen.append(asyncio.current_task())
        async with asyncio.timeout(10):  # binds to the caller's task, and is left before any wait
            seen.append("ran")

    handed: list[bool] = []
    assert await run_in_this_task(batch(), lambda: handed.append(True)) is False
    assert seen == [me, "ran"] and handed == []


async def test_a_batch_that_waits_hands_over_once_then_finishes_in_the_same_task() -> None:
    me = asyncio.current_task()
    events: list[object] = []
    gate, again = asyncio.Event(), asyncio.Event()

    async def batch() -> None:
        events.append("start")
        await gate.wait()
        events.append(asyncio.current_task())
        asyncio.get_running_loop().call_soon(again.set)
        await again.wait()  # a second suspension after the hand-over
        events.append("end")

    def on_wait() -> None:
        events.append("handed over")
        asyncio.get_running_loop().call_soon(gate.set)

    assert await run_in_this_task(batch(), on_wait) is True
    assert events == ["start", "handed over", me, "end"]


async def test_a_timeout_and_a_cancel_reach_a_batch_after_the_hand_over() -> None:
    outcome: list[str] = []
    scopes: list[asyncio.Timeout] = []
    blocked = asyncio.Event()

    async def batch() -> None:
        try:
            async with asyncio.timeout(None) as scope:  # entered in the first step, fires after the hand-over
                scopes.append(scope)
                await asyncio.Event().wait()
        except TimeoutError:
            outcome.append("timed out")
        try:
            blocked.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise

    def expire_now() -> None:  # the hand-over happened: make the first step's timeout fire
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: scopes[0].reschedule(loop.time()))

    async def runner() -> bool:
        return await run_in_this_task(batch(), expire_now)

    task = asyncio.create_task(runner())
    await asyncio.wait_for(blocked.wait(), 10)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert outcome == ["timed out", "cancelled"] and task.cancelled()


async def test_an_error_in_the_batch_reaches_the_caller() -> None:
    async def fails_at_once() -> None:
        raise KeyError("now")

    async def fails_later() -> None:
        gate = asyncio.Event()
        asyncio.get_running_loop().call_soon(gate.set)
        await gate.wait()
        raise KeyError("later")

    for coro in (fails_at_once(), fails_later()):
        try:
            await run_in_this_task(coro, lambda: None)
        except KeyError:
            continue
        raise AssertionError("the error was lost")
