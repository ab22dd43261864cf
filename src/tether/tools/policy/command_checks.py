"""The command and environment checks of a `Policy`: whether `cmd argv...` may run, and with which
environment variables. A denial always names the rule that denied it.

Command checks run in a fixed order, strongest first, so the rule a denial names is the one a person
would need to change (and `always-denied` is reported even when something else is wrong too):
`cmd.invalid`, `arg.invalid`, `always-denied` (the program, or a program it would run), then
`escape.substitution`, `escape.wrapper` / `escape.interactive`, `not-allowed` (the allowlist),
`deny-args`, `subcommand`, the program's own escapes (`inline-code`, `escape.find-exec`, ...; see
`tether.tools.shell.rules`) and, for `shell_execute_read`, `read-only`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from tether.tools.policy.model import CommandRule, Decision, Policy, _names
from tether.tools.shell import rules as shell_rules
from tether.tools.shell.code import is_long, letters
from tether.tools.shell.rules import ALWAYS_DENIED

# ---------------------------------------------------------------- commands


def _deny(rule: str, reason: str) -> Decision:
    return Decision(False, rule, reason)


def lifted(policy: Policy, rule: str) -> bool:
    """Whether the policy lifts this rule; `always-denied` and malformed input are never liftable."""
    if rule == "inline-code":
        return policy.allow_inline_code
    return rule.startswith("escape.") and rule.removeprefix("escape.") in policy.allow_escapes


def program_name(cmd: object) -> str | None:
    """The basename a command is judged by: a bare name, or an absolute path's last part."""
    if not isinstance(cmd, str) or not cmd or "\x00" in cmd:
        return None
    if "/" in cmd and not cmd.startswith("/"):
        return None  # `./sudo`, `bin/x`: relative paths would depend on cwd
    name = cmd.rsplit("/", 1)[-1]
    if name in ("", ".", "..") or re.search(r"\s", name):
        return None
    return name


def arg_matches(arg: str, pattern: str) -> bool:
    """Whether `arg` is the option `pattern` names, however the program would accept it spelled."""
    if pattern.startswith("--"):
        return is_long(arg, pattern[2:])
    if pattern.startswith("-") and len(pattern) == 2:
        return not arg.startswith("--") and pattern[1] in letters(arg)
    return arg == pattern or (pattern.startswith("-") and arg.startswith(pattern + "="))


def check_command(policy: Policy, cmd: str, argv: list[str], *, stdin: str | None = None,
                  read_only: bool = False) -> Decision:
    """Whether `cmd argv...` may run (as an argv list, never through a shell); the rule says why."""
    return _check(policy, cmd, list(argv), stdin, read_only, 0)


def _check(policy: Policy, cmd: str, args: list[str], stdin: str | None, read_only: bool, depth: int) -> Decision:
    name = program_name(cmd)
    if name is None:
        return _deny("cmd.invalid", f"{cmd!r} is not a program: give a bare name (ls) or an absolute path, "
                                    "and put arguments in argv")
    bad = next((a for a in args if not isinstance(a, str) or "\x00" in a), None)
    if bad is not None:
        return _deny("arg.invalid", f"argument {bad!r} is not a string without NUL bytes")
    if name.lower() in ALWAYS_DENIED:
        return _deny("always-denied", f"{name} is never allowed (no policy can allow "
                                      f"{', '.join(sorted(ALWAYS_DENIED))})")
    found = shell_rules.findings(name, args, stdin)
    hit = shell_rules.always_denied_in(text for f in found for text in f.payload)
    if hit:
        return _deny("always-denied", f"{name} would run {hit}, which is never allowed")
    subst = next((a for a in args if "$(" in a or "`" in a), None)
    if subst is not None and not lifted(policy, "escape.substitution"):
        return _deny("escape.substitution", f"argument {subst!r} contains $( or a backtick: no shell runs here, so "
                                            "nothing is substituted, and the program itself might evaluate it")
    outer = [f for f in found if f.rule in ("escape.wrapper", "escape.interactive")]
    for f in outer:
        if not lifted(policy, f.rule):
            return _deny(f.rule, f.reason)
    rule = policy.commands.get(name)
    if rule is None:
        return _deny("not-allowed", f"{name} is not in the policy's allowlist (commands)")
    denied = next((a for a in args for p in rule.deny_args if arg_matches(a, p)), None)
    if denied is not None:
        return _deny("deny-args", f"{name} {denied} is refused by the policy's deny_args for {name}")
    index = shell_rules.subcommand_index(name, args)
    sub = args[index] if index is not None else None
    if rule.subcommands is not None and sub not in rule.subcommands:
        return _deny("subcommand", f"{name} {sub or '(no subcommand)'} is not allowed; allowed: "
                                   f"{', '.join(rule.subcommands)}")
    for f in found:
        if f not in outer and not lifted(policy, f.rule):
            return _deny(f.rule, f.reason)
    if read_only:
        why = _read_only_problem(name, rule, args, sub, found)
        if why:
            return _deny("read-only", f"{why}; shell_execute_read runs only read-only commands")
    if outer and outer[0].rule == "escape.wrapper":
        return _check_wrapped(policy, name, args, stdin, read_only, depth)
    return Decision(True, f"commands.{name}", f"{name} is in the allowlist" + (" as read-only" if read_only else ""))


def _read_only_problem(name: str, rule: CommandRule, args: list[str], sub: str | None,
                       found: list[shell_rules.Finding]) -> str | None:
    if not rule.read_only:
        return f"{name} can change things"
    if rule.read_only_subcommands is not None and sub not in rule.read_only_subcommands:
        allowed = ", ".join(rule.read_only_subcommands)
        return f"{name} {sub or '(no subcommand)'} can change things (read-only subcommands: {allowed})"
    writes = next((a for a in args for p in rule.write_args if arg_matches(a, p)), None)
    if writes is not None:
        return f"{name} {writes} writes"
    if found:
        return found[0].reason
    return shell_rules.read_only_violation(name, args)


def _check_wrapped(policy: Policy, name: str, args: list[str], stdin: str | None, read_only: bool,
                   depth: int) -> Decision:
    """A wrapper the policy lets run: the program it wraps must pass the policy on its own."""
    unwrapped = shell_rules.unwrap(shell_rules.family(name), args)
    if unwrapped is None or not unwrapped[1] or depth >= 3:
        return _deny("escape.wrapper", f"tether cannot tell which program {name} runs, so lifting 'wrapper' "
                                       "does not cover it")
    assignments, inner = unwrapped
    env = dict(a.split("=", 1) for a in assignments)
    verdict = check_env(policy, env)
    if not verdict.allowed:
        return verdict
    decision = _check(policy, inner[0], inner[1:], stdin, read_only, depth + 1)
    return decision._replace(reason=f"{name} runs {inner[0]}: {decision.reason}")


def approval_asked(policy: Policy, decision: Decision, cmd: str) -> str | None:
    """The approval rule the policy's `ask` (or the program's `approve`) puts on a command, None when the
    decision stands as it is. Only an allowlist miss can be turned into a question: a command refused
    for any other reason (always denied, an escape, a denied argument) stays refused."""
    if not decision.allowed:
        return "ask.on-miss" if decision.rule == "not-allowed" and policy.ask != "off" else None
    if policy.ask == "always":
        return "ask.always"
    rule = policy.commands.get(program_name(cmd) or "")
    return "approve" if rule is not None and rule.approve else None


# ---------------------------------------------------------------- environment

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DENIED_ENV: frozenset[str] = frozenset(_names(
    "PATH HOME SHELL ENV BASH_ENV CDPATH GLOBIGNORE IFS PS4 PROMPT_COMMAND SHELLOPTS BASHOPTS EDITOR VISUAL PAGER "
    "MANPAGER BROWSER TAR_OPTIONS ZIPOPT ZIP UNZIP UNZIPOPT GZIP BZIP2 XZ_OPT XZ_DEFAULTS OPENSSL_CONF "
    "OPENSSL_ENGINES OPENSSL_MODULES JAVA_TOOL_OPTIONS _JAVA_OPTIONS JDK_JAVA_OPTIONS CLASSPATH PHPRC "
    "PHP_INI_SCAN_DIR AWKPATH AWKLIBPATH TERMINFO TERMINFO_DIRS INPUTRC HISTFILE HOSTALIASES RES_OPTIONS LOCPATH "
    "NLSPATH DBUS_SESSION_BUS_ADDRESS COMSPEC PSMODULEPATH MAKEFLAGS MFLAGS GOFLAGS"))
DENIED_ENV_PREFIXES: tuple[str, ...] = (
    "LD_", "DYLD_", "GIT_", "PYTHON", "PERL", "RUBY", "GEM_", "BUNDLE_", "BASH_FUNC_", "NODE_", "NPM_CONFIG_",
    "LUA_", "TCL", "R_", "JULIA_", "GCONV", "MALLOC_", "GLIBC_", "SSH_", "RSYNC_", "LESS", "XDG_", "GNUPG", "GPG_",
    "SYSTEMD_", "DOCKER_", "PIP_", "UV_", "CARGO_", "RUSTC",
)
SAFE_ENV: frozenset[str] = frozenset(_names(
    "NODE_ENV PYTHONUNBUFFERED PYTHONDONTWRITEBYTECODE PYTHONIOENCODING PYTHONUTF8 PYTHONHASHSEED"))


def check_env(policy: Policy, env: Mapping[str, str] | None) -> Decision:
    """Whether a command may set these environment variables.

    Variables like LD_PRELOAD, PYTHONSTARTUP, NODE_OPTIONS, GIT_SSH_COMMAND, BASH_ENV, TAR_OPTIONS or
    PATH change which code an allowed program loads or runs, so they are refused (rule `escape.env`)
    like the equivalent arguments; ordinary application settings (CI=1, DEBUG=1, NODE_ENV) pass.
    """
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key) or not isinstance(value, str) or "\x00" in value:
            return _deny("env.invalid", f"{key!r} is not a usable environment variable (NAME=text, no NUL)")
        upper = key.upper()
        if upper not in SAFE_ENV and (upper in DENIED_ENV or upper.startswith(DENIED_ENV_PREFIXES)) \
                and not lifted(policy, "escape.env"):
            return _deny("escape.env", f"{key} can change which code a program loads or runs, so a command may not "
                                       "set it")
    return Decision(True, "env", "environment accepted")
