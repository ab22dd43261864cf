"""How one MCP server is described in a device config (seed 003's `server_type` entries).

Besides how to reach a server, an entry says which of its tools the device exposes and which need a
person first (`allow_tools`, `deny_tools`, `approve_tools`, `autoApprove`, `approve_destructive`;
enforced by `tether.device.mcp.config.tool_rules`) and whether a stdio server runs inside the device's OS
sandbox (`sandbox`). The tools belong to code nobody here wrote: their own annotations are only
hints, so the config has the last word.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

# the keys that put an external server's tools under the device's policy (meaningless for built-in sets,
# whose tools the policy already guards argument by argument)
TOOL_POLICY_KEYS = ("allow_tools", "deny_tools", "approve_tools", "auto_approve", "approve_destructive")
DEFAULT_MAX_RESULT_BYTES = 4 * 1024 * 1024  # a larger tool result fails as too large (see `max_result_bytes`)


class MCPServerConfig(BaseModel):
    """`local` (a built-in tool set, or a Python module exposing an `mcp` server object),
    `stdio` (a command speaking MCP on stdin/stdout), `http` (a streamable-HTTP URL) or `sse` (the older
    HTTP+SSE transport's URL, which desktop clients still list as `type: sse`)."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(..., min_length=1)
    server_type: Literal["local", "stdio", "http", "sse"] = "local"
    toolset: str | None = Field(None, description="local: name of a built-in tool set (shell, files, system)")
    module: str | None = Field(None, description="local: importable module with an `mcp` server object")
    command: str | None = Field(None, description="stdio: the executable")
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] | None = None
    cwd: str | None = None
    url: str | None = Field(None, description="http: the streamable-HTTP endpoint; sse: the SSE endpoint")
    headers: dict[str, str] = Field(default_factory=dict, description="http/sse: sent on every request (may "
                                                                      "carry a token: never logged)")
    reset: bool = Field(False, description="restart this server when the device is reset")
    timeout: float | None = Field(None, gt=0, description="default per-call timeout in seconds")
    startup_timeout: float = Field(30.0, gt=0)
    max_result_bytes: int = Field(
        DEFAULT_MAX_RESULT_BYTES, ge=1024,
        description="largest tool result (or MCP message) taken from this server; a larger one fails the call as "
                    "too large, quickly, and the session stays usable")
    allow_tools: list[str] | None = Field(
        None, description="if set, the only tools of this server that are listed and callable")
    deny_tools: list[str] = Field(default_factory=list, description="tools never listed nor callable")
    approve_tools: list[str] = Field(
        default_factory=list, description="tools that always need a person's approval, whatever their annotations")
    auto_approve: list[str] = Field(
        default_factory=list, validation_alias=AliasChoices("auto_approve", "autoApprove", "alwaysAllow"),
        description="tools that never need approval, even when annotated destructive (desktop clients' "
                    "`autoApprove`; Roo Code's `alwaysAllow`)")
    approve_destructive: Literal["hinted", "strict"] = Field(
        "hinted", description="hinted: a tool needs approval when it declares destructiveHint: true; strict: "
                              "also when it declares nothing (MCP's own default), i.e. unless it declares "
                              "readOnlyHint: true or destructiveHint: false")
    sandbox: bool = Field(False, description="stdio: run the server inside the device's OS sandbox (bubblewrap)")

    @model_validator(mode="after")
    def _check_kind(self) -> MCPServerConfig:
        if self.server_type == "local" and bool(self.toolset) == bool(self.module):
            raise ValueError(f"local server '{self.namespace}' needs exactly one of 'toolset' or 'module'")
        if self.server_type == "stdio" and not self.command:
            raise ValueError(f"stdio server '{self.namespace}' needs a 'command'")
        if self.server_type in ("http", "sse") and not self.url:
            raise ValueError(f"{self.server_type} server '{self.namespace}' needs a 'url'")
        if self.sandbox and self.server_type != "stdio":
            raise ValueError(f"server '{self.namespace}': 'sandbox' applies to stdio servers only (a device "
                             f"starts no process for a {self.server_type} server)")
        policy_keys = sorted(self.model_fields_set.intersection(TOOL_POLICY_KEYS))
        if self.toolset and policy_keys:
            raise ValueError(f"server '{self.namespace}': {', '.join(policy_keys)} apply to external servers "
                             f"only; the policy guards built-in tool set '{self.toolset}' itself")
        for first, second in (("allow_tools", "deny_tools"), ("approve_tools", "auto_approve")):
            both = set(getattr(self, first) or ()) & set(getattr(self, second))
            if both:
                raise ValueError(f"server '{self.namespace}': {sorted(both)} in both '{first}' and '{second}'")
        return self

    def identity(self) -> str:
        """Two entries with the same identity share one server and one persistent session."""
        return self.model_dump_json(exclude={"reset", "timeout", "startup_timeout"})
