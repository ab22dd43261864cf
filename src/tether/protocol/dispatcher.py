"""The dispatcher interface the agent talks to: the same whether the device is local or remote."""

from __future__ import annotations

from abc import ABC, abstractmethod

from tether.protocol.models import Command, Result, ResultStatus


class BasicCommandDispatcher(ABC):
    """Sends commands to a device and returns one `Result` per command, never raising for a tool error."""

    @abstractmethod
    async def execute_commands(self, commands: list[Command], timeout: float = 6000) -> list[Result]:
        """Execute `commands` in order; a timeout or transport error yields failure results."""

    def generate_error_results(self, commands: list[Command], error: BaseException | str) -> list[Result]:
        """One failure per command, so a caller always gets exactly the results it asked for."""
        text = str(error) or type(error).__name__
        return [
            Result(
                status=ResultStatus.FAILURE,
                error=f"Error executing {command.tool_name}: {text}",
                result=None,
                call_id=command.call_id,
            )
            for command in commands
        ]
