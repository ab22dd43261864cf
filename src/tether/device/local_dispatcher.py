"""`LocalCommandDispatcher`: the dispatcher for local mode, with no network in between (seed 000)."""

from __future__ import annotations

import asyncio

from tether.device.client import DeviceClient
from tether.protocol.dispatcher import BasicCommandDispatcher
from tether.protocol.models import Command, Result
from tether.tools.context import EventSink


class LocalCommandDispatcher(BasicCommandDispatcher):
    """Runs commands on an in-process `DeviceClient`; a timeout cancels the batch (killing what it
    started) and fails exactly the commands that had no result yet."""

    def __init__(self, client: DeviceClient, *, session_id: str | None = None, agent_name: str | None = None,
                 process_name: str | None = None, root_name: str | None = None,
                 emit: EventSink | None = None) -> None:
        self.client = client
        self.session_id = session_id
        self.agent_name = agent_name
        self.process_name = process_name
        self.root_name = root_name
        self.emit = emit

    async def execute_commands(self, commands: list[Command], timeout: float = 6000,
                               early_exit: bool = True) -> list[Result]:
        done: list[Result] = []
        async with self.client.task_lock:
            self.client.session_id = self.session_id
            self.client.agent_name = self.agent_name
            self.client.process_name = self.process_name
            self.client.root_name = self.root_name
            try:
                async with asyncio.timeout(timeout) as scope:
                    return await self.client.execute_actions(commands, early_exit=early_exit, emit=self.emit,
                                                             on_result=done.append, deadline=scope.when())
            except TimeoutError:
                error: BaseException | str = f"timed out after {timeout:g}s"
            except Exception as exc:
                error = exc
            return done + self.generate_error_results(commands[len(done):], error)
