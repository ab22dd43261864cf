"""Shell tools: run one program from an argv list under the command policy — never through a shell.

`shell.run` is seed 004's skill (cmd + argv + cwd, dryRun, timeoutMs, streamed output); `shell_execute`
and `shell_execute_read` are seed 000's Linux tools, which take one command line. That line is split
into words the way a shell would, but shell syntax (pipes, redirections, `;`, `$(...)`, variables) is
refused with advice rather than half-supported: an agent must never believe a pipe ran when it did not.
Seed 004's own example runs with `cwd: '/'`; its policy says cwd must be allowed, and that wins here.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import os
import re
import shlex
import shutil
import signal
import time
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from tether.sandbox import SandboxUnavailable
from tether.sandbox.confine.limits import describe, exceeded
from tether.sandbox.layers.session import SessionLimit
from tether.tools.context import ToolContext
from tether.tools.errors import NeedsApproval, PolicyDenied, ToolError
from tether.tools.policy.command_checks import approval_asked, check_command, check_env, lifted, program_name
from tether.tools.policy.jail import approval_needed, check_cwd, real, within
from tether.tools.policy.model import ALWAYS_DENIED
from tether.tools.running.process import run_process
from tether.tools.runtime import ToolSet, tool
from tether.tools.shell import capture as shell_capture
from tether.tools.shell.egress_ask import egress_asker

logger = logging.getLogger(__name__)

_PIPE = "pipes are not supported: run each command separately with shell.run and pass data through stdin"
_LIST = "command lists (;, &&, ||, newlines) are not supported: send each command as its own step"
_REDIRECT = ("redirections (>, >>, <, 2>) are not supported: the output comes back in the result; write files "
             "with the files tools and pass input with shell.run's stdin")
_BACKGROUND = "background jobs (&) are not supported: every command runs to completion under a timeout"
_SUBST = ("command substitution ($(...), backticks) is not supported: run the inner command first and use its "
          "output")
_VARS = "shell variables are not expanded: write the value itself (shell.run takes env for the program)"
_GROUP = "subshells and grouping ( ... ) are not supported: send each command as its own step"
_COMMENT = "shell comments (#) are not supported: send only the command"
_VARIABLE = re.compile(r"\$[A-Za-z_{0-9?$!#@*-]")


def _unquoted_problem(line: str, i: int) -> str | None:
    rest = line[i:]
    if rest.startswith(("||", "&&")) or rest[0] in ";\n":
        return _LIST
    if rest.startswith("&>") or rest[0] in "<>":
        return _REDIRECT
    if rest[0] == "|":
        return _PIPE
    if rest[0] == "&":
        return _BACKGROUND
    if rest[0] == "`" or rest.startswith("$("):
        return _SUBST
    if _VARIABLE.match(rest):
        return _VARS
    if rest[0] in "()":
        return _GROUP
    if rest[0] == "#" and (i == 0 or line[i - 1] in " \t"):
        return _COMMENT
    return None


def shell_syntax_problem(line: str) -> str | None:
    """Advice for the first piece of shell syntax in `line` a shell would act on, or None.

    Quotes are tracked like a shell does, so `grep 'a|b' file` is fine while `ls | wc` is not.
    """
    quote: str | None = None
    i = 0
    while i < len(line):
        c = line[i]
        if quote == "'":
            quote = None if c == "'" else quote
        elif c == "\\":
            i += 2
            continue
        elif quote == '"':
            if c == '"':
                quote = None
            elif c == "`" or line.startswith("$(", i):
                return _SUBST
            elif _VARIABLE.match(line, i):
                return _VARS
        elif c in "'\"":
            quote = c
        elif problem := _unquoted_problem(line, i):
            return problem
        i += 1
    return None


def split_command(line: str) -> tuple[str, list[str]]:
    """(program, arguments) of a command line, split like a shell splits words; no shell syntax."""
    problem = shell_syntax_problem(line)
    if problem:
        raise ToolError(problem, {"unsupported_shell_syntax": True})
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise ToolError(f"cannot split the command line: {exc} (check the quotes)") from None
    if not words:
        raise ToolError("the command is empty")
    return words[0], words[1:]


def resolve_program(ctx: ToolContext, cmd: str, search: str | None = None) -> str:
    """The file `cmd` names, resolved once here: what the sandbox executes is this file, opened here.

    The policy judges `/some/dir/ls` as `ls`; that only holds if the file is the system's `ls`, not a
    shell the agent copied or symlinked there. So a program that lies (or links) inside the writable
    roots is refused (rule `escape.writable-executable`), however it was named (a path, or a PATH
    lookup), and so is a path through /proc (its magic links resolve differently in every process)
    and anything that really is `sudo` & co. The result is the real path, so a link swapped in later
    cannot change which file runs. A path below the temp dir names the file in the session's private
    /tmp where it has one (`Sandbox.map_tmp`: where its commands see it); another session's is refused.
    """
    if cmd.startswith("/proc/") or "/proc/" in os.path.normpath(cmd):
        raise PolicyDenied("cmd.invalid", f"{cmd} goes through /proc, whose links mean something else in every "
                                          "process; call the program by name or by its real path")
    if "/" not in cmd and search is None:
        search = search_path(ctx)
    sandbox = ctx.sandbox
    lookup = cmd
    if sandbox is not None and sandbox.private_tmp is not None and os.path.isabs(cmd):
        lookup = sandbox.map_tmp(ctx.session_id, cmd)
    found = shutil.which(lookup, path=search if "/" not in cmd else None)
    roots = writable_roots(ctx)
    strict = not lifted(ctx.policy, "escape.writable-executable")
    if found is None:
        elsewhere = shutil.which(cmd) if "/" not in cmd else None
        if elsewhere:
            raise PolicyDenied("escape.writable-executable",
                               f"{cmd} is only found at {elsewhere}, inside the writable roots, where anything could "
                               "have been placed under an allowed name; install it outside them")
        raise ToolError(f"command not found: {cmd}" + ("" if "/" in cmd else " (not on PATH)"))
    path = os.path.abspath(found)
    target = os.path.realpath(path)
    if sandbox is not None and sandbox.foreign_tmp(ctx.session_id, target):
        raise PolicyDenied("private_tmp", f"{cmd} lies in another session's private /tmp")
    if Path(target).name.lower() in ALWAYS_DENIED:
        raise PolicyDenied("always-denied", f"{cmd} is {target}, which is never allowed")
    placed = real(os.path.dirname(path)) / os.path.basename(path)
    if (within(placed, roots) or within(Path(target), roots)) and strict:
        raise PolicyDenied("escape.writable-executable",
                           f"{cmd} is {target}, inside the writable roots, where anything could have been placed "
                           f"under an allowed name; call the program by name (PATH entries inside the roots are "
                           f"skipped) or install it outside them")
    return target


def search_path(ctx: ToolContext) -> str:
    """PATH without its directories inside the writable roots (~/.local/bin, shims): a program found by
    name is then always one the agent could not have put there. The command gets the same PATH, so
    what it runs by name (and what an interpreter finds from its own argv[0]) is judged the same way."""
    dirs = os.environ.get("PATH", os.defpath).split(os.pathsep)
    if lifted(ctx.policy, "escape.writable-executable"):
        return os.pathsep.join(dirs)
    roots = [str(r).rstrip("/") + "/" for r in writable_roots(ctx)]
    return os.pathsep.join(d for d in dirs if d and not (os.path.realpath(d) + "/").startswith(tuple(roots)))


def writable_roots(ctx: ToolContext) -> list[Path]:
    """Everywhere a command could have written: the write roots and the live ones."""
    return [real(r) for r in (*ctx.policy.write_roots, *ctx.policy.live_write_roots)]


def require_sandbox(ctx: ToolContext, what: str) -> None:
    """No sandbox here: refuse to start a process when the policy requires one (a device serving a server)."""
    if ctx.sandbox is None and ctx.policy.require_sandbox:
        raise PolicyDenied("sandbox.required", f"{what} would run unconfined: this device has no sandbox "
                                               "(install bubblewrap and allow user namespaces), and its policy "
                                               "requires one (require_sandbox: true)")


def _operands(args: list[str]) -> list[str]:
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i + 1:]
        if not arg.startswith("-") or arg == "-":
            out.append(arg)
    return out


def approval_rule(ctx: ToolContext, cmd: str, args: list[str], workdir: Path) -> str | None:
    """The approval rule a deleting or moving command (rm, rmdir, mv) needs, like the files tools."""
    rule = ctx.policy.commands.get(program_name(cmd) or "")
    if rule is None or rule.approval is None:
        return None
    for operand in _operands(args):
        needed = approval_needed(ctx.policy, rule.approval, real(operand, workdir), ctx.temp_dir)
        if needed:
            return needed
    return None


def _emit(ctx: ToolContext, data: dict[str, Any]) -> None:
    try:
        ctx.emit("output", data)
    except Exception:
        logger.exception("output event sink failed; the command keeps running")


def _exit_summary(code: int, stderr: str) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    return f"exit code {code}" + (f": {last[:300]}" if last else "")


def _workdir(ctx: ToolContext, cwd: str | None) -> Path:
    """`check_cwd`, with a cwd below the temp dir judged in the session's private /tmp where it has one
    (`Sandbox.map_tmp`), and given back as its commands see it."""
    sandbox = ctx.sandbox
    if sandbox is None or sandbox.private_tmp is None or not cwd:
        return check_cwd(ctx.policy, cwd, ctx.secrets)
    workdir = check_cwd(ctx.policy, sandbox.map_tmp(ctx.session_id, cwd), ctx.secrets)
    if sandbox.foreign_tmp(ctx.session_id, str(workdir)):
        raise PolicyDenied("private_tmp", f"cwd {cwd!r} lies in another session's private /tmp")
    return Path(sandbox.unmap_tmp(ctx.session_id, str(workdir)))


async def _execute(ctx: ToolContext, cmd: str, args: list[str], *, cwd: str | None, env: dict[str, str] | None,
                   stdin: str | None, timeout: float | None, dry_run: bool, read_only: bool,
                   camel: bool, preview: bool = False) -> dict[str, Any]:
    """The one path every shell tool takes: policy, cwd jail, program, approval, then the process."""
    decision = check_command(ctx.policy, cmd, args, stdin=stdin, read_only=read_only)
    asked = approval_asked(ctx.policy, decision, cmd)  # the policy's `ask`: a question instead of a refusal
    if not decision.allowed and asked is None:
        raise PolicyDenied(decision.rule, decision.reason)
    verdict = check_env(ctx.policy, env)
    if not verdict.allowed:
        raise PolicyDenied(verdict.rule, verdict.reason)
    workdir = _workdir(ctx, cwd)
    search = search_path(ctx)
    program = resolve_program(ctx, cmd, search)
    preview_text = shlex.join([cmd, *args])
    require_sandbox(ctx, f"`{preview_text}`")
    sandbox = ctx.sandbox
    capture = sandbox is not None and not read_only and bool(sandbox.spec.write_roots)
    # Confined, a command's changes are judged as they happen (see shell_capture); unconfined, the
    # argument-level rules for rm/rmdir/mv are all there is.
    approval = None if capture else approval_rule(ctx, cmd, args, workdir)
    if ctx.approval is not None and capture and not preview:  # approved for held changes: are they the same?
        ctx = await shell_capture.claim_held(ctx, shell_capture.fingerprint(ctx, cmd, args, str(workdir), env, stdin))
    if dry_run:
        return {"ok": True, "dryRun": True, "preview": preview_text, "cwd": str(workdir), "allowed": True,
                "program": program, "rule": decision.rule, "needsApproval": asked or approval,
                "sandbox": sandbox.kind if sandbox else "none", "captured": capture}
    if asked and not ctx.approved_by:
        why = decision.reason if not decision.allowed else f"the policy asks before {cmd} runs ({asked})"
        raise NeedsApproval(asked, f"`{preview_text}`: {why}. Approve it once, always (add {program_name(cmd)} to "
                                   "this device's allowlist: tether policy allow), or deny it")
    if approval and not ctx.approved_by:
        raise NeedsApproval(approval, f"`{preview_text}` deletes or moves files outside the temp directory")
    key = shell_capture.fingerprint(ctx, cmd, args, str(workdir), env, stdin) if capture else ""
    held = await shell_capture.take_held(ctx, key) if capture and not preview else None
    if held is not None:  # approved: apply what the command did when it ran, without running it again
        body = dict(held.payload)
        body["changes"] = await shell_capture.apply_changes(ctx, held.layer, held.changes, body)
        body["applied_after_approval"] = True
        code = body.get("exitCode", body.get("exit_code"))
        if code is not None and code != 0:
            raise ToolError(_exit_summary(code, body["stderr"]), body)
        return body
    layer = sandbox.new_layer() if capture and sandbox is not None else None

    kept: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
    decoders = {name: codecs.getincrementaldecoder("utf-8")(errors="replace") for name in kept}
    pids: list[int] = []

    def on_output(stream: str, chunk: bytes) -> None:
        kept[stream] += chunk
        text = decoders[stream].decode(chunk)
        if text:
            _emit(ctx, {"stream": stream, "data": text, "call_id": ctx.call_id})

    def payload(code: int | None, out: bytes, err: bytes, cut: tuple[bool, bool], seconds: float) -> dict[str, Any]:
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        truncated = {"stdout": cut[0], "stderr": cut[1]}
        pid = pids[0] if pids else None
        if camel:
            return {"ok": code == 0, "stdout": stdout, "stderr": stderr, "exitCode": code,
                    "executionTime": round(seconds * 1000, 1), "truncated": truncated, "pid": pid}
        return {"ok": code == 0, "stdout": stdout, "stderr": stderr, "exit_code": code,
                "execution_time": round(seconds, 4), "truncated": truncated, "pid": pid}

    started = time.monotonic()
    limit = ctx.policy.max_output_bytes
    try:
        try:
            async with asyncio.timeout(timeout):
                result = await run_process([cmd, *args], executable=program, cwd=str(workdir),
                                           env={**(env or {}), "PATH": search},
                                           stdin=None if stdin is None else stdin.encode(), max_output=limit,
                                           on_output=on_output, on_start=pids.append, sandbox=sandbox, layer=layer,
                                           ask=egress_asker(ctx, timeout),
                                           session=(ctx.session_id, ctx.policy.limits.session_processes))
        except BaseException:
            if layer is not None:  # a command that did not end by itself changes nothing
                sandbox.release(layer)  # type: ignore[union-attr]
            raise
    except TimeoutError:
        out, err = bytes(kept["stdout"]), bytes(kept["stderr"])
        body = payload(None, out, err, (len(out) >= limit, len(err) >= limit), time.monotonic() - started)
        body["timedOut"] = True
        note = "; nothing it wrote was applied" if layer is not None else ""
        raise ToolError(f"`{preview_text}` timed out after {timeout:g}s; its process group was killed{note}",
                        body) from None
    except SessionLimit as exc:
        raise ToolError(f"denied by limit '{exc.rule}': {exc}", {"limit": exc.rule, "applied": False}) from None
    except (OSError, SandboxUnavailable) as exc:
        raise ToolError(f"could not start {cmd}: {getattr(exc, 'strerror', None) or exc}") from None
    body = payload(result.exit_code, result.stdout, result.stderr,
                   (result.stdout_truncated, result.stderr_truncated), result.duration_s)
    if sandbox is not None:
        body["sandbox"] = sandbox.kind
    if result.notes:
        body["notes"] = list(result.notes)
    if sandbox is not None and (over := exceeded(sandbox.spec.limits, result.exit_code, body["stderr"],
                                                 result.cpu_s)):
        if layer is not None:  # a command stopped by a limit did not finish its work: none of it is applied
            sandbox.release(layer)
        body["limit"] = over
        applied = "; nothing it wrote was applied" if layer is not None else ""
        raise ToolError(f"`{preview_text}` ran into the sandbox's limit {describe(sandbox.spec.limits, over)}"
                        f"{applied} ({_exit_summary(result.exit_code, body['stderr'])})", body)
    if layer is not None:
        changes = await shell_capture.capture(ctx, layer, body)  # off the event loop, within the policy's limits
        body["changes"] = await shell_capture.settle(ctx, key, layer, changes, body, preview_text, hold_only=preview)
        if preview:
            body["preview"] = True
    if result.exit_code != 0:
        raise ToolError(_exit_summary(result.exit_code, body["stderr"]), body)
    return body


@tool("shell.run", tool_type="action")
async def run(ctx: ToolContext, cmd: str, argv: list[str] = [],  # noqa: B006 (never mutated; the schema shows [])
              cwd: str | None = None, env: dict[str, str] | None = None, stdin: str | None = None,
              timeoutMs: Annotated[int, Field(gt=0)] | None = None, dryRun: bool = False,
              preview: bool = False) -> dict[str, Any]:
    """Run one program (a bare name like `git`, or an absolute path) with its arguments in argv, never
    through a shell, in cwd (required; it must lie inside the allowed roots). The program and its
    arguments must pass the command policy; dryRun checks everything and runs nothing. Returns
    {ok, stdout, stderr, exitCode, executionTime (ms), truncated, pid}; a non-zero exit fails the call
    with that payload attached.

    Output is streamed as `output` events while the command runs. `timeoutMs` ends the command (its
    whole process group) and returns what it printed so far; the command's own deadline still applies.
    """
    return await _execute(ctx, cmd, list(argv), cwd=cwd, env=env, stdin=stdin,
                          timeout=None if timeoutMs is None else timeoutMs / 1000, dry_run=dryRun,
                          read_only=False, camel=True, preview=preview)


@tool(tool_type="action")
async def shell_execute(ctx: ToolContext, command: str,
                        timeout: Annotated[float, Field(gt=0)] = 30) -> dict[str, Any]:
    """Run one command line such as `ls -la docs` in the home directory. It is split into words like a
    shell would, but never run by a shell: pipes, redirections, ;, &&, $(...) and variables are refused.
    The program and its arguments must pass the command policy. Returns {ok, stdout, stderr, exit_code,
    execution_time (s), truncated, pid}; a non-zero exit fails the call with that payload attached.
    """
    cmd, args = split_command(command)
    return await _execute(ctx, cmd, args, cwd=str(Path.home()), env=None, stdin=None, timeout=timeout,
                          dry_run=False, read_only=False, camel=False)


@tool(tool_type="data_collection")
async def shell_execute_read(ctx: ToolContext, command: str,
                             timeout: Annotated[float, Field(gt=0)] = 30) -> dict[str, Any]:
    """Run one read-only command line such as `ls -la` or `git status` in the home directory (no shell;
    see shell_execute). Only commands the policy marks read-only are accepted: no rm, git push, sed -i,
    sort -o, tee...
    """
    cmd, args = split_command(command)
    return await _execute(ctx, cmd, args, cwd=str(Path.home()), env=None, stdin=None, timeout=timeout,
                          dry_run=False, read_only=True, camel=False)


def shell_toolset() -> ToolSet:
    return ToolSet("shell", [run, shell_execute, shell_execute_read],
                   "Run programs from argv lists under the command policy; never through a shell")
