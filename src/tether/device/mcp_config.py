"""How one MCP server is described in a device config (seed 003's `server_type` entries)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MCPServerConfig(BaseModel):
    """`local` (a built-in tool set, or a Python module exposing an `mcp` server object),
    `stdio` (a command speaking MCP on stdin/stdout) or `http` (a streamable-HTTP URL)."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(..., min_length=1)
    server_type: Literal["local", "stdio", "http"] = "local"
    toolset: str | None = Field(None, description="local: name of a built-in tool set (shell, files, system)")
    module: str | None = Field(None, description="local: importable module with an `mcp` server object")
    command: str | None = Field(None, description="stdio: the executable")
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] | None = None
    cwd: str | None = None
    url: str | None = Field(None, description="http: the streamable-HTTP endpoint")
    headers: dict[str, str] = Field(default_factory=dict)
    reset: bool = Field(False, description="restart this server when the device is reset")
    timeout: float | None = Field(None, gt=0, description="default per-call timeout in seconds")
    startup_timeout: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _check_kind(self) -> MCPServerConfig:
        if self.server_type == "local" and bool(self.toolset) == bool(self.module):
            raise ValueError(f"local server '{self.namespace}' needs exactly one of 'toolset' or 'module'")
        if self.server_type == "stdio" and not self.command:
            raise ValueError(f"stdio server '{self.namespace}' needs a 'command'")
        if self.server_type == "http" and not self.url:
            raise ValueError(f"http server '{self.namespace}' needs a 'url'")
        return self

    def identity(self) -> str:
        """Two entries with the same identity share one server and one persistent session."""
        return self.model_dump_json(exclude={"reset", "timeout", "startup_timeout"})
