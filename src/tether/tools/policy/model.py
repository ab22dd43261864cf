"""The safety policy: what may run, where files may be touched, what needs a person's approval.

Everything here is a pure function of a `Policy` and its arguments, so the rules can be tested
as a table. A denial always names the rule that denied it. The command and environment checks are in
`tether.tools.policy.command_checks`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from tether import yaml12
from tether.sandbox.egress.rules import check_entries
from tether.tools.errors import NeedsApproval, PolicyDenied
from tether.tools.policy.protected_defaults import DEFAULT_PROTECTED
from tether.tools.policy.real_paths import PathMemo
from tether.tools.shell.rules import ALWAYS_DENIED

KNOWN_ESCAPES: frozenset[str] = frozenset({
    "substitution", "wrapper", "interactive", "env", "debugger", "writable-executable", "find-exec",
    "find-delete", "find-write", "sort-compress-program", "tar-exec", "rsync-rsh", "git-config", "git-exec",
    "ssh-command", "awk-exec", "sed-exec", "sed-write", "zip-exec", "wget-exec", "exec-option",
})


class CommandRule(BaseModel):
    """Per-command argument rules for one allowed program.

    `deny_args` and `write_args` entries match like the program would read them: `--long` also matches
    `--long=value` and GNU abbreviations (`--out` for `--output`); a one-letter `-x` also matches
    clusters (`-nx`) and attached values (`-xVALUE`); `-word` (find's `-delete`) and bare words match
    exactly.
    """

    model_config = ConfigDict(extra="forbid")

    read_only: bool = Field(False, description="usable by shell_execute_read")
    deny_args: list[str] = Field(default_factory=list, description="arguments (or --opt= prefixes) refused")
    subcommands: list[str] | None = Field(None, description="if set, the first non-option argument must be one")
    read_only_subcommands: list[str] | None = Field(
        None, description="if set, the only subcommands shell_execute_read may run (e.g. git status, not push)")
    write_args: list[str] = Field(default_factory=list,
                                  description="arguments that make a read-only program write (sed -i, sort -o)")
    approval: Literal["delete", "move"] | None = Field(
        None, description="this command deletes or moves its path arguments: the approval rules apply")
    approve: bool = Field(False, description="every run of this program needs a person's approval")


class ApprovalRules(BaseModel):
    """Which changes to existing files outside the temp dir wait for a person's approval."""

    model_config = ConfigDict(extra="forbid")

    delete: bool = True
    move: bool = True
    overwrite_outside_temp: bool = True


class ResourceLimits(BaseModel):
    """Caps on each sandboxed command's resources; 0 turns one off. The warden sets the process caps
    (tether.sandbox.confine.limits); `layer_files`/`layer_bytes` bound the layer a command leaves, checked by the
    capture (tether.sandbox.layers.layer.LayerLimits)."""

    model_config = ConfigDict(extra="forbid")

    memory_mb: int = Field(8192, ge=0, description="private writable memory of each process, MiB (RLIMIT_DATA)")
    processes: int = Field(1024, ge=0, description="processes and threads of one command together (its pid "
                                                   "namespace's pid_max; the kernel's floor is 300)")
    cpu_seconds: int = Field(3600, ge=0, description="CPU time of each process, seconds (RLIMIT_CPU)")
    file_size_mb: int = Field(8192, ge=0, description="largest file a command may write, MiB (RLIMIT_FSIZE)")
    open_files: int = Field(8192, ge=0, description="open files of each process (RLIMIT_NOFILE)")
    shm_mb: int = Field(512, ge=0, description="size of the command's private /dev/shm, MiB (0: half the memory)")
    layer_files: int = Field(
        250_000, ge=0, description="files, directories, links and deletions one sandboxed command may leave in its"
                                   " layer; over it the command fails, naming this limit, and applies nothing (0: off)")
    layer_bytes: int = Field(
        8 << 30, ge=0, description="bytes (allocated on disk: holes are free) one sandboxed command may leave in its"
                                   " layer; over it the command fails, naming this limit, and applies nothing (0: off)")
    session_files: int = Field(
        1_000_000, ge=0, description="files, directories and links the sandboxed commands of one session may create, "
                                     "all together; the command that would pass it fails, naming this limit, and "
                                     "applies nothing (0: off)")
    session_processes: int = Field(
        4096, ge=0, description="processes the sandboxed programs of one session may run at once, all together (a "
                                "command, applications it launched that still run); each start takes its pid cap "
                                "from what is left, and one that would get under 300 is refused, naming this limit "
                                "(0: off)")
    session_bytes: int = Field(
        32 << 30, ge=0, description="bytes the sandboxed commands of one session may write, all together; the command "
                                    "that would pass it fails, naming this limit, and applies nothing (0: off)")


DEFAULT_HIDDEN: tuple[str, ...] = (
    "~/.ssh", "~/.gnupg", "~/.aws", "~/.azure", "~/.config/gcloud", "~/.kube", "~/.docker", "~/.netrc",
    "~/.git-credentials", "~/.config/gh", "~/.password-store", "~/.local/share/keyrings", "~/.config/tether",
    "~/.local/state/tether", "~/.pgpass", "~/.npmrc", "~/.pypirc",
)


class NetworkRules(BaseModel):
    """`network: {allow, deny, ask}`: sandboxed commands reach only the listed hosts, through the egress proxy.

    Entries are `host`, `*.domain`, `*`, an address or a network (`10.0.0.0/8`), each with an optional
    `:port`; deny wins over allow; loopback, private and link-local addresses are refused unless an
    entry names the address, its network or the exact host name (tether.sandbox.egress.rules).
    """

    model_config = ConfigDict(extra="forbid")

    allow: list[str] = Field(default_factory=list, description="hosts commands may reach")
    deny: list[str] = Field(default_factory=list, description="hosts commands may never reach (wins over allow)")
    ask: Literal["off", "on-miss"] = Field("off", description="on-miss: an unlisted host asks a person "
                                                              "(once / always / deny) instead of being refused")
    within: NetworkRules | None = Field(
        None, description="rules every connection must pass too: where a server narrowed the device's list, the "
                          "device's own (docs/security/network.md)")

    @field_validator("allow", "deny")
    @classmethod
    def _entries_parse(cls, entries: list[str]) -> list[str]:
        return check_entries(entries)


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
    browser_allowed_origins: list[str] = Field(
        default_factory=list, description="origins browser.act may open (https://example.com, http://127.0.0.1:8000, "
                                          "https://*.example.com); empty: any origin of an allowed scheme")
    browser_allowed_schemes: list[str] = Field(
        default_factory=lambda: ["http", "https"],
        description="URL schemes browser.act may open; about:blank is always allowed")
    browser_allow_evaluate: bool = Field(False, description="whether browser.act may run the agent's JavaScript")
    # the OS sandbox around every process a device starts (tether.sandbox)
    sandbox: bool = Field(True, description="run every process the device starts in the OS sandbox; false: "
                                            "unconfined (refused anyway where require_sandbox is true)")
    require_sandbox: bool | None = Field(
        None, description="refuse to start processes when no sandbox can be made; unset: true for a device "
                          "serving a server, false for local `tether exec` / `tether run` (with a warning)")
    network: bool | NetworkRules = Field(
        True, description="sandboxed processes' network: on (true), off (false: loopback only), or "
                          "{allow: [host[:port], *.domain, address, network/bits], deny: [...], ask: off|on-miss}: "
                          "no direct network, only the device's egress proxy to the hosts the lists open "
                          "(docs/security/network.md)")
    hide_paths: list[str] = Field(
        default_factory=lambda: list(DEFAULT_HIDDEN),
        description="paths sandboxed processes see as empty (the device's state, token and config are always added)")
    protected_paths: list[str] = Field(
        default_factory=list, description="more places whose content another program later runs or loads, added to "
                                          "the default list (glob patterns: ~/x or /x anchored, a bare name matches at "
                                          "any depth); creating or changing one is always held for a person "
                                          "(docs/security/protected-paths.md)")
    unprotect_paths: list[str] = Field(
        default_factory=list, description="default protected entries to drop, each named exactly as in the default "
                                          "list (e.g. '.git/config'); anything else is an error")
    live_write_roots: list[str] = Field(
        default_factory=list, description="write roots bound directly into the sandbox: changes there happen at once "
                                          "and are neither captured, held for approval nor undoable")
    allow_sockets: list[str] = Field(
        default_factory=list, description="unix sockets outside the sandbox that sandboxed processes may connect to "
                                          "(absolute paths; 'sandbox': only sockets they bind themselves; '*': any, "
                                          "abstract ones too); empty: no unix socket at all")
    private_tmp: bool = Field(
        True, description="each session's sandboxed commands, file tools and transfers see their own /tmp "
                           "(where the temp dir is a write root): nothing one session leaves there is seen by "
                           "another, it is not captured, and it is removed when the session ends (or after a "
                           "day idle) (docs/security/ipc-and-limits.md); false: one captured /tmp for every "
                           "session")
    limits: ResourceLimits = Field(default_factory=ResourceLimits,
                                   description="each sandboxed command's memory, processes, CPU, file size, files, "
                                               "and the size of the layer it leaves")
    ask: Literal["off", "on-miss", "always"] = Field(
        "off", description="on-miss: a program outside the allowlist raises an approval instead of a refusal; "
                           "always: every command needs one; off: the allowlist decides alone")
    policy_remote: bool = Field(True, description="whether the server may change this policy (tether policy set); "
                                                  "only the device's own file can change this setting")
    mcp_sampling: Literal["off", "ask", "on"] = Field(
        "off", description="whether an external MCP server may ask the device's LLM for a completion (sampling): "
                           "off refuses, ask asks a person each time, on allows (budgeted per command, logged)")
    max_concurrent_sessions: int = Field(
        4, ge=1, le=256, description="sessions a device serving a server runs at once; the batches of further "
                                     "sessions wait in line (told their place by a 'queued' event)")
    # the real paths of hide_paths, protected places and roots, kept while they hold (tools/policy/real_paths.py)
    _path_memo: PathMemo = PrivateAttr(default_factory=PathMemo)

    @field_validator("commands")
    @classmethod
    def _names_are_programs(cls, commands: dict[str, CommandRule]) -> dict[str, CommandRule]:
        for name in commands:
            if not name or "/" in name or name != name.strip():
                raise ValueError(f"{name!r} is not a program name (use the basename, e.g. 'git')")
            if name.lower() in ALWAYS_DENIED:
                raise ValueError(f"{name!r} is always denied and no policy can allow it")
        return commands

    @field_validator("network", mode="before")
    @classmethod
    def _network_shape(cls, value: Any) -> Any:
        """on/off (true/false) or a mapping of rules, with one clear message when it is neither."""
        if isinstance(value, str) and value.strip().lower() in ("on", "off", "true", "false"):
            return value.strip().lower() in ("on", "true")
        if isinstance(value, bool | NetworkRules):
            return value
        if isinstance(value, Mapping):
            try:
                return NetworkRules.model_validate(value)
            except ValidationError as exc:
                raise ValueError("; ".join(_explain(err) for err in exc.errors(include_url=False))) from None
        raise ValueError(f"network is on, off, or {{allow: [hosts], deny: [hosts], ask: off|on-miss}}, not "
                         f"{_shown_value(value)}")

    @field_validator("unprotect_paths")
    @classmethod
    def _unprotect_defaults_only(cls, names: list[str]) -> list[str]:
        for name in names:
            if name not in DEFAULT_PROTECTED:
                raise ValueError(f"{name!r} is not a default protected path; unprotect_paths names default entries "
                                 "exactly as listed in docs/security/protected-paths.md")
        return names

    @field_validator("allow_sockets")
    @classmethod
    def _sockets_are_paths(cls, sockets: list[str]) -> list[str]:
        for entry in sockets:
            if entry not in ("*", "sandbox") and not os.path.isabs(os.path.expanduser(entry)):
                raise ValueError(f"{entry!r} is not a socket path: give an absolute path (or ~/...), 'sandbox' or '*'")
        return sockets

    @field_validator("allow_escapes")
    @classmethod
    def _escapes_are_known(cls, names: list[str]) -> list[str]:
        for name in names:
            if name == "inline-code":
                raise ValueError("inline code is lifted with 'allow_inline_code: true', not allow_escapes")
            if name not in KNOWN_ESCAPES:
                raise ValueError(f"unknown escape {name!r}; known: {', '.join(sorted(KNOWN_ESCAPES))}")
        return names


class Decision(NamedTuple):
    """A check's verdict: `allowed`, the `rule` that decided, and the `reason` in words."""

    allowed: bool
    rule: str
    reason: str


def _names(text: str) -> list[str]:
    return text.split()


_GIT_SUBCOMMANDS = _names(
    "status log diff show branch add commit checkout switch restore reset init clone fetch pull push merge rebase "
    "stash tag rev-parse ls-files remote blame grep mv rm describe shortlog reflog cherry-pick revert apply version")
_FIND_WRITES = _names("-delete -fprint -fprint0 -fprintf -fls -exec -execdir -ok -okdir")


def _default_commands() -> dict[str, CommandRule]:
    """A dev-machine allowlist: read-only tools, file tools, git, archives and the two script runtimes."""
    rules = {name: CommandRule(read_only=True) for name in _names(
        "ls cat head tail wc echo printf pwd grep egrep fgrep whoami id uname df du stat which ps basename dirname "
        "realpath readlink sha256sum md5sum cut tr cmp diff seq sleep true false test")}
    rules |= {name: CommandRule() for name in _names("mkdir touch cp ln tee tar gzip gunzip zip unzip python3 "
                                                     "python node awk uniq")}
    rules |= {
        "date": CommandRule(read_only=True, write_args=["-s", "--set"]),
        "hostname": CommandRule(read_only=True, write_args=["-F", "--file", "-b", "--boot"]),
        "file": CommandRule(read_only=True, write_args=["-C", "--compile"]),
        "sort": CommandRule(read_only=True, write_args=["-o", "--output"]),
        "sed": CommandRule(read_only=True, write_args=["-i", "--in-place"]),
        "find": CommandRule(read_only=True, write_args=_FIND_WRITES),
        "git": CommandRule(read_only=True, subcommands=_GIT_SUBCOMMANDS, write_args=["--output"],
                           read_only_subcommands=_names("status log diff show branch rev-parse ls-files blame")),
        "rm": CommandRule(approval="delete", deny_args=["--no-preserve-root"]),
        "rmdir": CommandRule(approval="delete"),
        "mv": CommandRule(approval="move"),
    }
    return rules


def default_policy() -> Policy:
    """The policy a device runs without a policy file: the default allowlist, every other setting at its default."""
    return Policy(commands=_default_commands())


def policy_from_mapping(data: Mapping[str, Any] | None, *, where: str = "policy") -> Policy:
    """A policy from parsed YAML/JSON. `commands` extends the default allowlist (an entry replaces the
    default rule of that name; `name: null` removes it) unless `replace_commands: true` is set."""
    if data is None:
        return default_policy()
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: a policy must be a mapping of settings, not {type(data).__name__}")
    settings = dict(data)
    replace = settings.pop("replace_commands", False)
    if not isinstance(replace, bool):
        raise ValueError(f"{where}: 'replace_commands' must be true or false, not {type(replace).__name__}")
    commands = settings.pop("commands", None) or {}
    if not isinstance(commands, Mapping):
        raise ValueError(f"{where}: 'commands' must map program names to rules, not {type(commands).__name__}")
    merged: dict[str, Any] = {} if replace else dict(_default_commands())
    for name, rule in commands.items():
        if rule is None:
            merged.pop(name, None)
        else:
            merged[name] = {} if rule is True else rule
    try:
        return Policy.model_validate({**settings, "commands": merged})
    except ValidationError as exc:
        raise ValueError(f"{where}: " + "; ".join(_explain(err) for err in exc.errors(include_url=False))) from None


def _shown_value(value: object) -> str:
    """A value from a policy file as an error shows it: a short word as it is, else only its type."""
    if isinstance(value, str) and value.strip().lower() in ("yes", "no", "y", "n", "1", "0", "enabled", "disabled"):
        return repr(value)
    return "a number" if isinstance(value, int | float) else f"a {type(value).__name__}"


def _explain(err: Any) -> str:
    loc = ".".join(yaml12.shown_key(p) for p in err["loc"]) or "(policy)"
    if err["type"] == "extra_forbidden":
        return f"unknown key '{loc}'"
    return f"'{loc}': {err['msg'].removeprefix('Value error, ')}"


def load_policy(path: str | os.PathLike[str] | None) -> Policy:
    """The policy in a YAML file (an empty file means the defaults); None → the defaults."""
    if path is None:
        return default_policy()
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{file}: cannot read policy file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{file}: not valid YAML: {yaml12.where_and_why(exc)}") from None
    import yaml  # only with a policy file: a device or `tether exec` with the defaults never loads it

    try:
        data = yaml12.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{file}: not valid YAML: {yaml12.where_and_why(exc)}") from None
    return policy_from_mapping(data, where=str(file))


__all__ = [
    "ALWAYS_DENIED", "KNOWN_ESCAPES", "ApprovalRules", "CommandRule", "Decision", "NeedsApproval", "NetworkRules",
    "Policy", "PolicyDenied", "ResourceLimits", "default_policy", "load_policy", "policy_from_mapping",
]
