"""Approvals bound to what the person saw: a digest the device computes when it asks, and again before it acts.

When a command needs a person (`NeedsApproval`), the device answers with `approval_digest`: sha256 over
what the question is about — the tool, its arguments in full (argv, cwd, env, stdin, paths, content), the
program `cmd` resolves to (its real path and the sha256 of its bytes), every existing file an argument
names (a script, a file to overwrite or delete: its sha256), and for a command whose changes were held in
the sandbox, the held change list with the sha256 of each new content. The approval sends the digest
back (`Command.approval_digest`); before running or applying anything the device computes it again. Equal:
the approval holds. Different (the script was edited, the program replaced, other changes held): nothing
runs or is applied, and the command comes back needing approval again, with the new digest.

An approval without a digest (`tether exec --approve`, a person sending a command they wrote as approved)
is taken as before: it approves the command as sent. See docs/security/approvals.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.protocol.models import Command, Result
    from tether.tools.context import ToolContext

PREFIX = "sha256:"
MAX_HASHED_BYTES = 64 << 20  # a file larger than this is named by (size, mtime, inode), not read whole
MAX_DIGEST_BYTES = 128 << 20  # all the files one digest reads, at most (then the rest are named as above)
MAX_NAMED_FILES = 64  # arguments looked at as file names, at most (argv of a huge glob)
_PATH_KEYS = ("path", "source", "destination", "src", "dst", "dest", "target", "file", "script")
_CHUNK = 1 << 20
_PSEUDO = ("/proc/", "/sys/", "/dev/")


@dataclass(frozen=True, slots=True)
class ApprovalClaim:
    """An approval whose digest did not match the command alone: it may still be for the command's held
    changes (`matches(changes_digest)`), which only the tool holding them can tell."""

    by: str
    digest: str
    facts: str  # the command's own facts, hashed (`command_facts`)

    def matches(self, changes_digest: str | None) -> bool:
        return combine(self.facts, changes_digest) == self.digest


class _Budget:
    """The bytes one digest may still read (MAX_DIGEST_BYTES in all): the files past it are named by their
    size, mtime and inode, so a command naming many large files cannot make the device read gigabytes."""

    def __init__(self, left: int = 0) -> None:
        self.left = left or MAX_DIGEST_BYTES

    def take(self, size: int) -> bool:
        if size > MAX_HASHED_BYTES or size > self.left:
            return False
        self.left -= size
        return True


def file_identity(path: str, budget: _Budget | None = None) -> dict[str, Any] | None:
    """What a file is now: its real path and the sha256 of its bytes (or its size, mtime and inode past
    MAX_HASHED_BYTES, or past what the digest's `budget` may still read); None when nothing regular is there."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    if real.startswith(_PSEUDO):  # a kernel's file: new bytes at every read (a uuid), named by its path only
        return {"path": real}
    if not (budget or _Budget()).take(st.st_size):
        return {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
    digest = hashlib.sha256()
    try:
        with open(real, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except OSError:
        return None
    return {"path": real, "sha256": digest.hexdigest()}


def _program(cmd: str, cwd: str | None, budget: _Budget) -> dict[str, Any] | None:
    if "/" in cmd:
        found: str | None = cmd if os.path.isabs(cmd) or not cwd else os.path.join(cwd, cmd)
    else:
        found = shutil.which(cmd)
    return file_identity(found, budget) if found else None


def _named_files(params: dict[str, Any], cwd: str | None, budget: _Budget) -> dict[str, Any]:
    """Each argument that names an existing regular file (relative ones from `cwd`): its identity."""
    names: list[str] = [params[k] for k in _PATH_KEYS if isinstance(params.get(k), str)]
    argv = params.get("argv", params.get("args"))
    if isinstance(argv, list):
        names += [a for a in argv if isinstance(a, str) and a and not a.startswith("-")]
    seen: dict[str, Any] = {}
    for name in names[:MAX_NAMED_FILES]:
        if len(name) > 4096 or "\0" in name:
            continue
        where = name if os.path.isabs(name) or not cwd else os.path.join(cwd, name)
        identity = file_identity(os.path.expanduser(where), budget)
        if identity is not None:
            seen[name] = identity
    return seen


def command_facts(tool_name: str, params: dict[str, Any] | None) -> str:
    """The digest of everything about a command that an approval of it stands for (see the module)."""
    params = params or {}
    cwd = params.get("cwd") if isinstance(params.get("cwd"), str) else None
    budget = _Budget()
    facts: dict[str, Any] = {"tool": tool_name, "params": params}
    if isinstance(params.get("cmd"), str) and params["cmd"]:  # the program first: it runs, whatever else
        facts["program"] = _program(params["cmd"], cwd, budget)
    facts["files"] = _named_files(params, cwd, budget)
    if cwd:
        facts["cwd"] = os.path.realpath(os.path.expanduser(cwd))
    return _hash(facts)


def changes_digest(changes: Iterable[Any]) -> str:
    """The digest of a held change list: each change's path, kind, type, origin, mode, what the real
    tree held, and the sha256 of its new content (a file's bytes, a link's target)."""
    listed = []
    budget = _Budget()
    for c in changes:
        content: Any = None
        if c.source and c.kind != "deleted":
            if c.node == "symlink":
                try:
                    content = os.readlink(c.source)
                except OSError:
                    content = None
            elif c.node == "file":
                identity = file_identity(c.source, budget)
                if identity is not None:  # past the budget: size, mtime and inode (another layer's differ)
                    content = identity.get("sha256") or [identity.get(k) for k in ("size", "mtime_ns", "inode")]
        listed.append([c.path, c.kind, c.node, c.moved_from, c.mode, list(c.was) if c.was else None, content])
    return _hash(listed)


def combine(facts: str, changes: str | None) -> str:
    """The approval digest of a command (`command_facts`) and, when it held changes, of those."""
    return facts if changes is None else _hash([facts, changes])


def _hash(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=False)
    return PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def bind(ctx: ToolContext, command: Command) -> ToolContext:
    """The call's context for a command sent approved with a digest: approved when the digest is the
    command's as it is now; otherwise not approved (the tool asks again), with the claim kept for a tool
    that held changes for this approval (`ApprovalClaim.matches`)."""
    if not command.approved_by or not command.approval_digest:
        return ctx
    facts = command_facts(command.tool_name, command.parameters)
    if facts == command.approval_digest:
        return ctx
    return dataclasses.replace(ctx, approved_by=None,
                               approval=ApprovalClaim(command.approved_by, command.approval_digest, facts))


def mark(result: Result, command: Command) -> Result:
    """A needs-approval result with its `approval_digest` (what a person is asked about; see the module);
    when the command was sent approved for another digest, its error says that it changed and is asked again."""
    payload = result.result
    if result.ok or not isinstance(payload, dict) or payload.get("needs_approval") is not True:
        return result
    held = payload.get("changes_digest")
    facts = command_facts(command.tool_name, command.parameters)
    digest = combine(facts, held if isinstance(held, str) else None)
    error = result.error
    # approved to run (facts), and now its held changes are asked about: a new question, not a changed one
    if command.approved_by and command.approval_digest and command.approval_digest not in (digest, facts):
        error = (f"what was approved has changed since (approved {command.approval_digest[:19]}..., now "
                 f"{digest[:19]}...): nothing was run or applied, and it is asked again. {error or ''}").strip()
    return result.model_copy(update={"result": {**payload, "approval_digest": digest}, "error": error})
