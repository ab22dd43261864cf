"""Which tools of an external MCP server a device lists and calls, and which need a person first.

An external server's tools are code nobody here wrote, so the device config decides and the tools'
own MCP annotations only fill in what the config leaves open:

- `deny_tools`: never listed, never called (rule `mcp.deny_tools`);
- `allow_tools`: when set, every other tool is treated as denied (rule `mcp.allow_tools`);
- `approve_tools`: always need an approval (rule `approval.mcp_approve_tools`);
- `autoApprove` (`auto_approve`): never need one, even when annotated destructive;
- otherwise the annotations: `readOnlyHint: true` makes a tool `data_collection` and needs no
  approval; `destructiveHint: true` needs one (rule `approval.mcp_destructive`).

MCP's own default for a tool that declares nothing is "may be destructive". Taken literally that
would hold almost every third-party tool for approval (most servers annotate nothing) and teach
people to approve blindly, so by default (`approve_destructive: hinted`) only an explicit
`destructiveHint: true` asks; `approve_destructive: strict` follows MCP's default and asks for every
tool that does not declare `readOnlyHint: true` or `destructiveHint: false`.

A refusal is the same `PolicyDenied` / `NeedsApproval` a built-in tool raises (its result carries
`{"denied"|"needs_approval": true, "rule": ...}`), so the task loop's approval path works unchanged:
the command is re-sent with `approved_by` set. A denial comes first and no approval lifts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tether.device.mcp.config.server_config import MCPServerConfig
from tether.protocol.models import ToolType
from tether.tools.errors import NeedsApproval, PolicyDenied

if TYPE_CHECKING:
    import mcp_types  # annotations only: built-in tools never import the MCP SDK's types

RULE_DENY = "mcp.deny_tools"
RULE_ALLOW = "mcp.allow_tools"
RULE_APPROVE = "approval.mcp_approve_tools"
RULE_DESTRUCTIVE = "approval.mcp_destructive"


def annotated_type(annotations: mcp_types.ToolAnnotations | None, configured: ToolType) -> ToolType:
    """A tool that declares itself read-only collects data, whatever list its server was configured in."""
    if annotations is not None and annotations.read_only_hint is True:
        return "data_collection"
    return configured


@dataclass(frozen=True, slots=True)
class MCPToolPolicy:
    """One server's tool rules, as sets (checked on every call: a few hash lookups)."""

    namespace: str
    allow: frozenset[str] | None = None
    deny: frozenset[str] = frozenset()
    approve: frozenset[str] = frozenset()
    auto_approve: frozenset[str] = frozenset()
    strict: bool = False

    @classmethod
    def from_config(cls, config: MCPServerConfig) -> MCPToolPolicy:
        return cls(namespace=config.namespace,
                   allow=None if config.allow_tools is None else frozenset(config.allow_tools),
                   deny=frozenset(config.deny_tools), approve=frozenset(config.approve_tools),
                   auto_approve=frozenset(config.auto_approve), strict=config.approve_destructive == "strict")

    @property
    def named(self) -> frozenset[str]:
        """Every tool name the config mentions (to warn about names the server does not offer)."""
        return (self.allow or frozenset()) | self.deny | self.approve | self.auto_approve

    def visible(self, name: str) -> bool:
        """Whether the tool may be listed (and so registered, shown in profiles and `list_tools`)."""
        return name not in self.deny and (self.allow is None or name in self.allow)

    def refusal(self, name: str) -> PolicyDenied | None:
        """The denial for a tool the config keeps from the agent; None when it may be called."""
        if name in self.deny:
            return PolicyDenied(RULE_DENY, f"tool '{name}' of server '{self.namespace}' is in its deny_tools")
        if self.allow is not None and name not in self.allow:
            return PolicyDenied(RULE_ALLOW, f"tool '{name}' of server '{self.namespace}' is not in its allow_tools")
        return None

    def approval(self, name: str, annotations: mcp_types.ToolAnnotations | None) -> NeedsApproval | None:
        """Why a call to this (not denied) tool must wait for a person; None when it may run now."""
        if name in self.approve:
            return NeedsApproval(RULE_APPROVE, f"tool '{name}' of server '{self.namespace}' is in its "
                                               f"approve_tools")
        if name in self.auto_approve:
            return None
        read_only = annotations.read_only_hint if annotations is not None else None
        destructive = annotations.destructive_hint if annotations is not None else None
        if read_only is True:
            return None
        if destructive is True:
            return NeedsApproval(RULE_DESTRUCTIVE, f"server '{self.namespace}' marks tool '{name}' destructive "
                                                   f"(destructiveHint); list it in the server's autoApprove "
                                                   f"to run it without asking")
        if destructive is None and self.strict:
            return NeedsApproval(RULE_DESTRUCTIVE, f"tool '{name}' of server '{self.namespace}' declares neither "
                                                   f"readOnlyHint nor destructiveHint: false, and the server is "
                                                   f"configured with approve_destructive: strict")
        return None
