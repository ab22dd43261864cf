"""`run_in_this_task`: carry a batch's coroutine on to its end in the task that started it."""

from __future__ import annotations

import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any


async def run_in_this_task(batch: Coroutine[Any, Any, None], on_wait: Callable[[], None]) -> bool:
    """Run a batch from `BatchRunner.submit(run_here=True)` in the calling task. A batch that finishes
    without waiting (built-in tools mostly do) just returns False. One that has to wait first calls
    `on_wait` (the caller lets go of whatever else it was doing: the task is the batch's from now
    on), is carried on to its end in this task, and True is returned."""
    try:
        waiting_on = batch.send(None)
    except StopIteration:
        return False
    on_wait()
    await _carry_on(batch, waiting_on)
    return True


@types.coroutine
def _carry_on(coro: Coroutine[Any, Any, None], waiting_on: Any) -> Generator[Any, Any, None]:
    """`await coro` for a coroutine whose first step already ran and is waiting on `waiting_on`."""
    while True:
        try:
            sent = yield waiting_on
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # a cancellation of this task: the batch handles it
            try:
                waiting_on = coro.throw(exc)
            except StopIteration:
                return
        else:
            try:
                waiting_on = coro.send(sent)
            except StopIteration:
                return
