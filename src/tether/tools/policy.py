"""The safety policy: what may run, where files may be touched, what needs a person's approval.

Everything here is a pure function of a `Policy` and its arguments, so the rules can be tested
as a table. A denial always names the rule that denied it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field

from tether.tools.errors import NeedsApproval, PolicyDenied

ALWAYS_DENIED: frozenset[str] = frozenset({"sudo", "su", "passwd", "doas"})


class CommandRule(BaseModel):
    """Per-command argument rules for one allowed program."""

    model_config = ConfigDict(extra="forbid")

    read_only: bool = Field(False, description="usable by shell_execute_read")
    deny_args: list[str] = Field(default_factory=list, description="arguments (or --opt= prefixes) refused")
    subcommands: list[str] | None = Field(None, description="if set, the first non-option argument must be one")


class ApprovalRules(BaseModel):
    model_config = ConfigDict(extra="forbid")

    delete: bool = True
    move: bool = True
    overwrite_outside_temp: bool = True


class Policy(BaseModel):
    """Loaded from YAML; every field has a safe default."""

    model_config = ConfigDict(extra="forbid")

    commands: dict[str, CommandRule] = Field(default_factory=dict)
    allow_inline_code: bool = False
    allow_escapes: list[str] = Field(default_factory=list)
    read_roots: list[str] = Field(default_factory=lambda: ["~", tempfile.gettempdir()])
    write_roots: list[str] = Field(default_factory=lambda: ["~", tempfile.gettempdir()])
    approval: ApprovalRules = Field(default_factory=ApprovalRules)
    max_output_bytes: int = Field(1024 * 1024, gt=0)
    default_timeout: float = Field(60.0, gt=0)


class Decision(NamedTuple):
    allowed: bool
    rule: str
    reason: str


def default_policy() -> Policy:
    raise NotImplementedError


def load_policy(path: str | os.PathLike[str] | None) -> Policy:
    raise NotImplementedError


def check_command(policy: Policy, cmd: str, argv: list[str], *, stdin: str | None = None,
                  read_only: bool = False) -> Decision:
    raise NotImplementedError


__all__ = [
    "ALWAYS_DENIED", "ApprovalRules", "CommandRule", "Decision", "NeedsApproval", "Policy", "PolicyDenied",
    "check_command", "default_policy", "load_policy", "yaml",
]
