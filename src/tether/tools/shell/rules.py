"""Argument-level escapes: the ways an allowed program can be made to run something else.

An allowlist of names stops `sudo` but not `find -exec sudo`, `python -c`, `sort --compress-program=sh`
or `git -c core.pager=sh`: each turns an allowed program into a launcher for any code. Each checker
here knows one program family's options well enough to spot those arguments in the spellings an
attacker would try (combined short flags, `--opt=value`, GNU long-option abbreviations, old-style tar
letters). Where a checker cannot be sure, it reports a finding: unknown must mean denied. Every rule
is pure string work, so it can be tested as a table.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tether.tools.shell.code import (
    CODE_CHECKS,
    Checker,
    Finding,
    cluster,
    is_long,
    letters,
    long_opt,
    sed_args,
    sed_effects,
    value_of,
)

ALWAYS_DENIED: frozenset[str] = frozenset({"sudo", "su", "passwd", "doas", "sudoedit", "pkexec", "runuser",
                                           "chpasswd"})


def _names(text: str) -> list[str]:
    return text.split()


def words(text: str) -> Iterable[str]:
    """Program-name-like words in `text`, by basename, for the always-denied scan."""
    for word in re.split(r"[\s;|&()<>`'\"=,:{}\[\]!$%+*?#~\\@]+", text):
        if word:
            yield word.rsplit("/", 1)[-1].lower()


def always_denied_in(texts: Iterable[str]) -> str | None:
    return next((w for t in texts for w in words(t) if w in ALWAYS_DENIED), None)


# ---------------------------------------------------------------- families

_FAMILIES: list[tuple[re.Pattern[str], str]] = [(re.compile(p), f) for p, f in [
    # Loose on purpose: `python3-dbg`, `python3.11d`, `perl5.36`, `original-awk` get their family's rules.
    (r"(python|pypy).*", "python"), (r"perl.*", "perl"), (r"node.*", "node"), (r"(j|truffle)?ruby.*", "ruby"),
    (r"php.*", "php"), (r"lua.*", "lua"),
    (r"(ba|da|z|k|mk|pdk|a|ya|c|tc|fi|rba|po)?sh|ksh93|elvish|nu|xonsh|pwsh|powershell", "shell"),
    (r"(bun|deno|rscript|r|julia|osascript|tclsh|wish|expect|guile|racket|sbcl|clisp|scala|groovy|jshell"
     r"|ghci|erl|elixir|iex|swift|irb|ipython\d*|jython)", "interpreter"),
    (r".*awk", "awk"), (r"g?sed", "sed"), (r"g?find", "find"), (r"g?sort", "sort"), (r"(g|bsd)?tar", "tar"),
    (r"rsync", "rsync"), (r"git", "git"), (r"ssh|scp", "ssh"), (r"zip", "zip"), (r"wget", "wget"),
    (r"fd|fdfind", "fd"), (r"rg", "rg"),
]]

# Wrappers run the program named in their arguments. Those with a spec can be followed when the
# policy lifts `wrapper` (the wrapped command is then checked on its own); the rest cannot be.
_WrapSpec = tuple[str, tuple[str, ...], int]  # short options with a value, long ones, leading positionals
WRAPPERS: dict[str, _WrapSpec | None] = {
    "env": ("uCa", ("unset", "chdir", "argv0"), 0), "nice": ("n", ("adjustment",), 0), "nohup": ("", (), 0),
    "timeout": ("sk", ("signal", "kill-after"), 1), "stdbuf": ("ioe", ("input", "output", "error"), 0),
    "setsid": ("", (), 0), "time": ("fo", ("format", "output"), 0), "ionice": ("cn", ("class", "classdata"), 0),
    "taskset": ("", (), 1), "chrt": ("TPD", (), 1),
    **dict.fromkeys(_names(
        "xargs watch strace ltrace chroot flock script parallel busybox command exec builtin unshare nsenter "
        "prlimit numactl cgexec eatmydata faketime fakeroot fakechroot firejail systemd-run runcon sg newgrp "
        "setpriv capsh catchsegv valgrind daemonize start-stop-daemon setarch linux32 linux64 unbuffer rlwrap "
        "proxychains proxychains4 torsocks torify dbus-launch dbus-run-session ssh-agent xvfb-run entr sem "
        "chpst envdir setuidgid softlimit")),
}
# Programs that run commands typed into them (`!cmd` in less, vi, ftp, sqlite3 .shell, dc, crontab...).
INTERACTIVE = frozenset(_names(
    "less more most pg vi vim nvim view vimdiff rvim ex ed red emacs emacsclient nano pico joe jed mc man "
    "info pinfo screen tmux ftp sftp lftp ncftp telnet mysql mariadb psql sqlite3 gdb lldb pdb dc mail "
    "mailx mutt crontab at batch top htop"))


def family(name: str) -> str:
    """The rule family of a program basename: `python3.11` → python, `gsed` → sed, `ls` → ls."""
    low = name.lower()
    if low.startswith("g") and low[1:] in WRAPPERS:
        return low[1:]  # gtimeout, genv, gxargs: GNU tools installed under a prefix (macOS)
    return next((f for pattern, f in _FAMILIES if pattern.fullmatch(low)), low)


def unwrap(fam: str, args: list[str]) -> tuple[list[str], list[str]] | None:
    """(NAME=VALUE assignments, wrapped argv) of a followable wrapper, or None when it cannot be told."""
    spec = WRAPPERS.get(fam)
    if spec is None:
        return None
    short_values, long_values, positionals = spec
    assignments: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if fam == "env" and ("S" in letters(arg, short_values) or is_long(arg, "split-string")):
            return None  # env -S re-splits a string into a new argv
        if fam == "nice" and re.fullmatch(r"-\d+", arg):
            i += 1
            continue
        if long_opt(arg):
            i += 1 if "=" in arg or not is_long(arg, *long_values) else 2
            continue
        if arg.startswith("-") and len(arg) > 1:
            cl = cluster(arg, short_values)
            i += 2 if cl and cl[-1][0] in short_values and not cl[-1][1] else 1
            continue
        if fam == "env" and "=" in arg:
            assignments.append(arg)
            i += 1
            continue
        break
    i += positionals
    return (assignments, args[i:]) if i < len(args) else None


# ---------------------------------------------------------------- tools with an exec option


def check_find(args: list[str], stdin: str | None) -> list[Finding]:
    found: list[Finding] = []
    for i, arg in enumerate(args):
        word = arg.lstrip("-") if arg.startswith("-") else ""
        if word in ("exec", "execdir", "ok", "okdir"):
            end = next((j for j in range(i + 1, len(args)) if args[j] in (";", "+")), len(args))
            found.append(Finding("escape.find-exec", f"find {arg} runs a program for every match",
                                 tuple(args[i + 1:end])))
        elif word == "delete":
            found.append(Finding("escape.find-delete", "find -delete removes every match"))
        elif word in ("fprint", "fprint0", "fprintf", "fls"):
            found.append(Finding("escape.find-write", f"find {arg} writes a file"))
    return found


def check_sort(args: list[str], stdin: str | None) -> list[Finding]:
    return [Finding("escape.sort-compress-program", "sort --compress-program runs the program it names",
                    (value_of(args, i),)) for i, a in enumerate(args) if is_long(a, "compress-program")]


_TAR_EXEC = ("to-command", "use-compress-program", "info-script", "new-volume-script", "rsh-command",
             "rmt-command")


def check_tar(args: list[str], stdin: str | None) -> list[Finding]:
    found: list[Finding] = []
    for i, arg in enumerate(args):
        hit = is_long(arg, *_TAR_EXEC) or (
            is_long(arg, "checkpoint-action", exact=("checkpoint",)) and value_of(args, i).lower().startswith("exec"))
        letters_ = arg if i == 0 and not arg.startswith("-") else letters(arg, "bCfFgHIKLNTVX")
        if hit or set(letters_) & {"I", "F"}:
            found.append(Finding("escape.tar-exec", f"tar {arg} runs a program of the caller's choice",
                                 (value_of(args, i),)))
    return found


def check_rsync(args: list[str], stdin: str | None) -> list[Finding]:
    return [Finding("escape.rsync-rsh", f"rsync {a} runs a program of the caller's choice", tuple(args[i:i + 2]))
            for i, a in enumerate(args) if is_long(a, "rsh", "rsync-path", "remote-option")
            or (a.startswith("-") and not a.startswith("--") and set(a[1:]) & set("eM"))]


_SSH_EXEC_OPTIONS = frozenset({"proxycommand", "localcommand", "permitlocalcommand", "knownhostscommand", "match",
                               "pkcs11provider", "securitykeyprovider", "include", "proxyusefdpass"})


def check_ssh(args: list[str], stdin: str | None, prog: str = "ssh") -> list[Finding]:
    found: list[Finding] = []
    for i, arg in enumerate(args):
        for ch, attached in cluster(arg, "BbcDEeFIiJLlmOoPpQRSWwX"):
            value = attached or (args[i + 1] if i + 1 < len(args) else "")
            key = re.split(r"[\s=]", value.strip(), maxsplit=1)[0].lower()
            if (ch == "o" and key in _SSH_EXEC_OPTIONS) or ch == "F" or (ch == "I" and prog == "ssh") \
                    or (ch in "SD" and prog != "ssh"):
                found.append(Finding("escape.ssh-command", f"{prog} -{ch} {value} can run a local program",
                                     (value,)))
    return found


def check_exec_option(args: list[str], stdin: str | None, long: tuple[str, ...], short: str = "") -> list[Finding]:
    """Options that run a program per file: fd's `-x/--exec`, `-X/--exec-batch`, ripgrep's `--pre`."""
    return [Finding("escape.exec-option", f"{a} runs a program of the caller's choice", tuple(args[i:i + 2]))
            for i, a in enumerate(args) if is_long(a, *long) or set(letters(a)) & set(short)]


def check_zip(args: list[str], stdin: str | None) -> list[Finding]:
    return [Finding("escape.zip-exec", "zip -TT/--unzip-command runs a program to test the archive",
                    tuple(args[i:i + 2])) for i, a in enumerate(args)
            if is_long(a, "unzip-command") or (a.startswith("-") and not a.startswith("--") and "TT" in a)]


def check_wget(args: list[str], stdin: str | None) -> list[Finding]:
    return [Finding("escape.wget-exec", f"wget {a} runs a program or a wgetrc command", tuple(args[i:i + 2]))
            for i, a in enumerate(args) if is_long(a, "use-askpass", "execute")
            or (a.startswith("-") and not a.startswith("--") and "e" in a)]


# git: config keys whose value is a command, a program, a hook location or more config to include.
_GIT_EXEC_SECTIONS = frozenset({"alias", "filter", "diff", "merge", "difftool", "mergetool", "credential", "gpg",
                                "ssh", "protocol", "uploadpack", "receive", "pager", "man", "web", "browser",
                                "instaweb", "sendemail", "submodule", "hook", "include", "includeif", "url",
                                "sequence", "uploadarchive", "trace2"})
_GIT_EXEC_KEY_END = ("cmd", "command", "program", "helper", "path", "editor", "pager", "proxy", "hook", "hookspath",
                     "driver", "textconv", "askpass", "fsmonitor", "templatedir", "uploadpack", "receivepack",
                     "vcs", "worktree")
_GIT_GLOBAL_VALUE = frozenset({"-C", "-c", "--git-dir", "--work-tree", "--namespace", "--config-env",
                               "--super-prefix", "--list-cmds", "--attr-source"})


def git_key_execs(key: str) -> bool:
    key = key.split("=", 1)[0].strip().lower()
    return key.split(".", 1)[0] in _GIT_EXEC_SECTIONS or key.endswith(_GIT_EXEC_KEY_END)


def git_subcommand(args: list[str]) -> int | None:
    """Index of git's subcommand, skipping global options (and the values of `-C DIR`, `-c K=V`...)."""
    i = 0
    while i < len(args):
        if args[i] in _GIT_GLOBAL_VALUE:
            i += 2
        elif args[i].startswith("-"):
            i += 1
        else:
            return i
    return None


def _git_config(setting: str) -> Finding:
    if git_key_execs(setting):
        return Finding("escape.git-exec", f"git config {setting.split('=')[0]!r} names a program git would run",
                       (setting,))
    return Finding("escape.git-config", "git -c/--config-env overrides configuration (it can name programs to run)",
                   (setting,))


def check_git(args: list[str], stdin: str | None) -> list[Finding]:
    found: list[Finding] = []
    sub = git_subcommand(args)
    head = args if sub is None else args[:sub]
    for i, arg in enumerate(head):
        if arg.startswith("-c") or (arg.startswith("--c") and is_long(arg, "config-env")):
            found.append(_git_config(arg[2:] if arg.startswith("-c") and len(arg) > 2 else value_of(head, i)))
        elif arg.startswith("--exec-path="):
            found.append(Finding("escape.git-exec", "--exec-path makes git run its helpers from elsewhere", (arg,)))
    if sub is None:
        return found
    name, rest = args[sub].lower(), args[sub + 1:]
    exec_flags = {"clone": "u", "ls-remote": "u", "rebase": "x", "grep": "O", "difftool": "xt"}.get(name, "")
    for i, arg in enumerate(rest):
        if is_long(arg, "upload-pack", "receive-pack", "exec", "template", "extcmd", "open-files-in-pager", "tool") \
                or set(letters(arg)) & set(exec_flags) or re.match(r"(ext|fd)::", arg, re.I):
            found.append(Finding("escape.git-exec", f"git {name} {arg} runs a program of the caller's choice",
                                 tuple(rest[i:i + 2])))
        elif name == "clone" and (arg.startswith("-c") or is_long(arg, "config")):
            found.append(_git_config(arg[2:] if arg.startswith("-c") and len(arg) > 2 else value_of(rest, i)))
        elif name == "config" and not arg.startswith("-") and git_key_execs(arg):
            found.append(_git_config(arg))
    if (name, rest[:1]) in (("bisect", ["run"]), ("submodule", ["foreach"])) or name in (
            "filter-branch", "mergetool", "instaweb", "web--browse"):
        found.append(Finding("escape.git-exec", f"git {name} runs commands of the caller's choice", tuple(rest)))
    return found


TOOLS: dict[str, Checker] = {**CODE_CHECKS, "find": check_find, "sort": check_sort, "tar": check_tar,
                             "rsync": check_rsync, "git": check_git, "zip": check_zip, "wget": check_wget,
                             "fd": lambda a, s: check_exec_option(a, s, ("exec", "exec-batch"), "xX"),
                             "rg": lambda a, s: check_exec_option(a, s, ("pre",))}


# ---------------------------------------------------------------- entry points


def findings(name: str, args: list[str], stdin: str | None) -> list[Finding]:
    """Every escape in this command line, lifted or not (the caller decides what the policy allows)."""
    fam = family(name)
    if fam in WRAPPERS:
        how = "is checked on its own" if WRAPPERS[fam] else "cannot be checked"
        return [Finding("escape.wrapper", f"{name} runs another program (which {how}); run that program directly",
                        (*args, stdin or ""))]
    if fam in INTERACTIVE:
        return [Finding("escape.interactive", f"{name} runs shell commands typed into it (shell escapes)",
                        (stdin or "",))]
    if fam == "ssh":
        return check_ssh(args, stdin, name.lower())
    checker = TOOLS.get(fam)
    return checker(args, stdin) if checker else []


def subcommand_index(name: str, args: list[str]) -> int | None:
    if family(name) == "git":
        return git_subcommand(args)
    return next((i for i, a in enumerate(args) if not a.startswith("-")), None)


_BRANCH_LISTING = frozenset({"-a", "--all", "-r", "--remotes", "-l", "--list", "-v", "-vv", "--verbose",
                             "--show-current", "--contains", "--no-contains", "--merged", "--no-merged",
                             "--points-at", "--sort", "--format", "--color", "--no-color", "--column",
                             "--no-column", "-i", "--ignore-case", "--abbrev", "--no-abbrev", "-q", "--quiet",
                             "--omit-empty"})
_BRANCH_VALUE = frozenset({"--contains", "--no-contains", "--merged", "--no-merged", "--points-at", "--sort",
                           "--format"})


def _positionals(args: list[str], valued: Iterable[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in valued
        else:
            out.append(arg)
    return out


def read_only_violation(name: str, args: list[str]) -> str | None:
    """Why an otherwise read-only program would change something with these arguments, or None."""
    fam = family(name)
    if fam == "git" and (sub := git_subcommand(args)) is not None and args[sub] == "branch":
        rest = args[sub + 1:]
        bad = next((a for a in rest if a.startswith("-") and a.split("=")[0] not in _BRANCH_LISTING), None)
        if bad or (_positionals(rest, _BRANCH_VALUE) and not {"-l", "--list"} & set(rest)):
            return f"git branch {bad or 'NAME'} creates, renames or deletes branches (use --list to filter)"
    if fam == "sed" and "write" in sed_effects("\n".join(sed_args(args)[0])):
        return "the sed script writes a file"
    if fam == "hostname" and _positionals(args, ()):
        return "hostname NAME sets the host name"
    if fam == "date" and [a for a in _positionals(args, ("-d", "--date", "-f", "--file", "-r", "--reference"))
                          if not a.startswith("+")]:
        return "date with a time argument sets the clock"
    return None
