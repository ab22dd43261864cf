"""The command policy as tables: every known bypass is denied by the rule that names it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tether.tools.policy.command_checks import check_command, check_env
from tether.tools.policy.model import (
    ALWAYS_DENIED,
    KNOWN_ESCAPES,
    CommandRule,
    Policy,
    default_policy,
    load_policy,
    policy_from_mapping,
)
from tether.tools.shell.code import sed_effects
from tether.tools.shell.rules import WRAPPERS

DEFAULT = default_policy()
# Programs outside the default allowlist, so their own escape rules (not `not-allowed`) can be seen.
EXTRA = ["python3.11", "perl", "ruby", "php", "bash", "sh", "zsh", "dash", "fish", "lua", "rsync", "ssh", "scp",
         "wget", "gawk", "mawk", "deno", "Rscript", "nice", "env", "timeout", "xargs", "less", "python3-dbg",
         "original-awk", "fd", "rg"]
BROAD = DEFAULT.model_copy(update={"commands": {**DEFAULT.commands, **{n: CommandRule() for n in EXTRA}}})

ALLOWED = [
    ("ls", ["-la"], None), ("cat", ["notes.txt"], None), ("echo", ["sudo", "rm", "-rf"], None),
    ("grep", ["-r", "sudo", "."], None), ("date", ["+%s"], None), ("ps", ["aux"], None),
    ("/bin/ls", ["-l"], None), ("/usr/bin/git", ["status"], None),
    ("python3", ["script.py"], None), ("python3", ["script.py", "-c", "config.yaml"], None),
    ("python3", ["-u", "script.py"], "data on stdin"), ("python3", ["-m", "http.server", "0"], None),
    ("python3", ["-Wc", "script.py"], None), ("python3", ["--version"], None),
    ("node", ["app.js"], None), ("node", ["app.js"], "data on stdin"),
    ("find", [".", "-name", "*.py", "-type", "f"], None), ("sort", ["-k2", "-u", "data.txt"], None),
    ("tar", ["-czf", "out.tgz", "src"], None), ("tar", ["--checkpoint=10", "-cf", "a.tar", "."], None),
    ("tar", ["tf", "a.tar"], None), ("zip", ["-r", "a.zip", "src"], None), ("unzip", ["-l", "a.zip"], None),
    ("git", ["status"], None), ("git", ["-C", "/tmp/repo", "log", "--oneline"], None),
    ("git", ["push", "-u", "origin", "main"], None), ("git", ["add", "-u"], None),
    ("git", ["commit", "-m", "fix: $HOME is literal here"], None),
    ("awk", ["{print $1}", "f"], None), ("awk", ["-F:", "{print $1}", "/etc/passwd"], None),
    ("awk", ["/error|warn/ {print $2}", "log"], None), ("awk", ['$1 == "a" || $2 == "b"', "f"], None),
    ("sed", ["s/a/b/", "f"], None), ("sed", ["-n", "1,5p", "f"], None), ("sed", ["-i.bak", "s/x/y/g", "f"], None),
    ("sed", [r":a;N;$!ba;s/\n/ /g", "f"], None), ("sed", ["-E", "s|/usr|/opt|g", "f"], None),
    ("sed", ["1i header", "f"], None), ("sed", ["s/e/E/g;/^#/d", "f"], None),
    ("rm", ["-rf", "build"], None), ("cp", ["-r", "a", "b"], None), ("mv", ["a", "b"], None),
    ("tee", ["out.txt"], "text"), ("mkdir", ["-p", "a/b"], None),
]


@pytest.mark.parametrize(("cmd", "argv", "stdin"), ALLOWED)
def test_allowed(cmd: str, argv: list[str], stdin: str | None) -> None:
    decision = check_command(DEFAULT, cmd, argv, stdin=stdin)
    assert decision.allowed, decision
    assert decision.rule == f"commands.{cmd.rsplit('/', 1)[-1]}"


DENIED = [
    # never, by any name or through any wrapper
    ("sudo", ["id"], None, "always-denied"), ("su", [], None, "always-denied"), ("passwd", [], None, "always-denied"),
    ("doas", ["ls"], None, "always-denied"), ("/usr/bin/sudo", ["id"], None, "always-denied"),
    ("SUDO", [], None, "always-denied"), ("env", ["sudo", "id"], None, "always-denied"),
    ("nice", ["sudo", "id"], None, "always-denied"), ("nice", ["-n", "5", "/usr/bin/sudo"], None, "always-denied"),
    ("timeout", ["5", "sudo", "id"], None, "always-denied"), ("xargs", ["sudo"], None, "always-denied"),
    ("xargs", [], "sudo\nid", "always-denied"), ("env", ["-S", "sudo id"], None, "always-denied"),
    ("stdbuf", ["-oL", "doas", "sh"], None, "always-denied"),
    ("find", [".", "-exec", "sudo", "rm", "{}", ";"], None, "always-denied"),
    ("python3", ["-c", "import os; os.system('sudo id')"], None, "always-denied"),
    ("git", ["-c", "core.pager=sudo less", "log"], None, "always-denied"),
    # wrappers
    *[(w, args, None, "escape.wrapper") for w, args in [
        ("nice", ["ls"]), ("nohup", ["ls"]), ("timeout", ["5", "ls"]), ("watch", ["ls"]), ("strace", ["ls"]),
        ("time", ["ls"]), ("stdbuf", ["-oL", "ls"]), ("setsid", ["ls"]), ("chroot", ["/", "ls"]),
        ("xargs", ["rm"]), ("env", ["ls"]), ("/usr/bin/env", ["python3", "-c", "1"]), ("gtimeout", ["1", "ls"]),
        ("gxargs", ["ls"])]],
    # inline code
    *[(c, a, s, "inline-code") for c, a, s in [
        ("python3", ["-c", "print(1)"], None), ("python", ["-Sc", "print(1)"], None),
        ("python3", ["-BSc", "1"], None), ("python3", ["-W", "ignore", "-c", "1"], None),
        ("python3", ["-i", "script.py"], None), ("python3", [], "print(1)"), ("python3", ["-"], "print(1)"),
        ("python3", ["/dev/stdin"], "print(1)"), ("python3", ["-u"], "print(1)"),
        ("python3", ["/proc/self/fd/../fd/0"], "1"), ("python3", ["/proc/thread-self/fd/0"], "1"),
        ("python3", ["-m", "timeit", "1"], None), ("python3", ["-mpdb", "x.py"], None),
        ("node", ["-e", "1"], None), ("node", ["--eval", "1"], None), ("node", ["--eval=1"], None),
        ("node", ["-p", "1+1"], None), ("node", ["-pe", "1"], None), ("node", ["--print", "1"], None),
        ("node", ["-i"], None), ("node", [], "console.log(1)"), ("node", ["-"], "1"),
        ("node", ["--import=data:text/javascript,console.log(1)", "app.js"], None)]],
    ("node", ["--inspect", "app.js"], None, "escape.debugger"),
    ("node", ["--inspect-brk=0.0.0.0:9229", "app.js"], None, "escape.debugger"),
    # find, sort, tar, zip
    *[("find", a, None, "escape.find-exec") for a in (
        [".", "-exec", "rm", "{}", ";"], [".", "-execdir", "sh", "-c", "id", ";"], [".", "-ok", "rm", "{}", ";"],
        [".", "-okdir", "rm", "{}", ";"])],
    ("find", [".", "-name", "x", "-delete"], None, "escape.find-delete"),
    *[("find", a, None, "escape.find-write") for a in (
        [".", "-fprint", "/tmp/out"], [".", "-fprintf", "/tmp/out", "%p"], [".", "-fls", "/tmp/out"])],
    *[("sort", a, None, "escape.sort-compress-program") for a in (
        ["--compress-program=sh", "f"], ["--compress-program", "sh", "f"], ["--compress-prog=sh", "f"])],
    *[("tar", a, None, "escape.tar-exec") for a in (
        ["-xf", "a.tar", "--to-command=sh"], ["-cf", "a.tar", "--checkpoint=1", "--checkpoint-action=exec=sh", "."],
        ["-cf", "a.tar", "--checkpoint-action", "exec=id", "."], ["-I", "sh", "-cf", "a.tar", "."],
        ["-cIsh", "-f", "a.tar", "."], ["--use-compress-program=sh", "-cf", "a.tar", "."],
        ["cIf", "sh", "a.tar", "."], ["-cf", "a.tar", "-F", "sh", "."], ["--rsh-command=/bin/sh", "-cf", "h:a", "."])],
    ("zip", ["-T", "-TT", "sh -c id", "a.zip", "f"], None, "escape.zip-exec"),
    ("zip", ["--unzip-command=sh", "-T", "a.zip", "f"], None, "escape.zip-exec"),
    # git
    ("git", ["-c", "user.name=x", "commit"], None, "escape.git-config"),
    ("git", ["--config-env=user.name=X", "log"], None, "escape.git-config"),
    *[("git", a, None, "escape.git-exec") for a in (
        ["-c", "core.sshCommand=sh", "fetch"], ["-c", "core.pager=sh", "log"], ["-c", "core.fsmonitor=x", "status"],
        ["-c", "alias.lg=!sh", "log"], ["--config-env=core.sshCommand=EVIL", "fetch"],
        ["fetch", "--upload-pack=sh", "origin"], ["push", "--receive-pack=sh", "origin"],
        ["push", "--exec=sh", "origin"], ["clone", "-u", "sh", "url", "d"], ["clone", "--template=/tmp/t", "url"],
        ["clone", "-c", "core.hooksPath=/tmp/h", "url"], ["clone", "ext::sh -c id", "d"],
        ["rebase", "--exec", "sh", "main"], ["rebase", "-x", "sh", "main"],
        ["grep", "--open-files-in-pager=sh", "x"], ["grep", "-Osh", "x"], ["--exec-path=/tmp/x", "status"])],
    ("git", ["config", "core.pager", "sh"], None, "subcommand"),
    ("git", ["submodule", "foreach", "id"], None, "subcommand"), ("git", ["daemon"], None, "subcommand"),
    # awk and sed programs
    *[("awk", a, None, "escape.awk-exec") for a in (
        ['BEGIN { system("id") }'], ['{ print | "sh" }'], ['BEGIN { "id" | getline x; print x }'],
        ['BEGIN { print "id" |& "sh" }'], ['BEGIN { f = "sys" "tem"; @f("id") }'], ["-f", "prog.awk", "data"],
        ["-e", 'BEGIN { system("id") }'], ["-l", "evil", "1"], ["-W", "exec", "prog.awk"],
        ['BEGIN { print "x" > "/inet/tcp/0/example.com/80" }'], ['{ printf "%s\\n", $0 | "sh" }'])],
    *[("sed", a, None, "escape.sed-exec") for a in (
        ["1e id", "f"], ["e id"], ["s/.*/id/e", "f"], ["-n", "s/x/y/gpe"], ["-e", "p", "-e", "$e id", "f"],
        ["--expression=1e id", "f"], ["-f", "script.sed", "f"], ["/x/{e id\n}", "f"], ["s/[/]/x/e", "f"])],
    ("sed", ["s/a/b/w /tmp/out", "f"], None, "escape.sed-write"),
    ("sed", ["w /tmp/out", "f"], None, "escape.sed-write"),
    # arguments, program names, interactive programs, the allowlist
    ("echo", ["$(id)"], None, "escape.substitution"), ("echo", ["`id`"], None, "escape.substitution"),
    ("ls", ["a$(id)b"], None, "escape.substitution"), ("echo", ["a\x00b"], None, "arg.invalid"),
    ("./ls", [], None, "cmd.invalid"), ("bin/ls", [], None, "cmd.invalid"), ("", [], None, "cmd.invalid"),
    ("ls -la", [], None, "cmd.invalid"), ("/usr/bin/", [], None, "cmd.invalid"),
    *[(p, a, None, "escape.interactive") for p, a in (
        ("less", ["f"]), ("vi", ["f"]), ("vim", ["f"]), ("man", ["ls"]), ("sqlite3", ["db"]), ("crontab", ["-e"]))],
    ("bash", ["-c", "id"], None, "not-allowed"), ("curl", ["http://x"], None, "not-allowed"),
    ("python3.11", ["-c", "1"], None, "not-allowed"),
    ("rm", ["-rf", "--no-preserve-root", "/"], None, "deny-args"), ("rm", ["--no-preserve", "/"], None, "deny-args"),
]


@pytest.mark.parametrize(("cmd", "argv", "stdin", "rule"), DENIED)
def test_denied(cmd: str, argv: list[str], stdin: str | None, rule: str) -> None:
    decision = check_command(DEFAULT, cmd, argv, stdin=stdin)
    assert not decision.allowed and decision.rule == rule, decision
    assert decision.reason


FAMILIES = [  # allowed in BROAD, so each program's own rules decide
    ("python3.11", ["-c", "1"], None, "inline-code"), ("perl", ["-e", "1"], None, "inline-code"),
    ("perl", ["-E", "say 1"], None, "inline-code"), ("perl", ["-lne", "print"], None, "inline-code"),
    ("perl", ["-Mstrict;system('id')", "x.pl"], None, "inline-code"), ("perl", ["-de", "0"], None, "inline-code"),
    ("perl", [], "print 1", "inline-code"), ("ruby", ["-e", "1"], None, "inline-code"),
    ("ruby", ["-ne", "print"], None, "inline-code"), ("php", ["-r", "echo 1;"], None, "inline-code"),
    ("bash", ["-c", "id"], None, "inline-code"), ("bash", ["-xc", "id"], None, "inline-code"),
    ("sh", ["-c", "id"], None, "inline-code"), ("zsh", ["-c", "id"], None, "inline-code"),
    ("dash", ["-ec", "id"], None, "inline-code"), ("fish", ["--command", "id"], None, "inline-code"),
    ("bash", ["-s"], "id", "inline-code"), ("bash", [], "id", "inline-code"), ("bash", ["-i"], None, "inline-code"),
    ("lua", ["-e", "os.execute('id')"], None, "inline-code"), ("deno", ["eval", "1"], None, "inline-code"),
    ("Rscript", ["-e", "system('id')"], None, "inline-code"),
    ("rsync", ["-e", "sh", "a", "b"], None, "escape.rsync-rsh"), ("rsync", ["--rsh=sh", "a", "b"], None,
                                                                    "escape.rsync-rsh"),
    ("rsync", ["-avze", "sh", "a", "b"], None, "escape.rsync-rsh"),
    ("ssh", ["-o", "ProxyCommand=sh -c id", "h"], None, "escape.ssh-command"),
    ("ssh", ["-oLocalCommand=id", "-oPermitLocalCommand=yes", "h"], None, "escape.ssh-command"),
    ("ssh", ["-F", "evil.cfg", "h"], None, "escape.ssh-command"),
    ("scp", ["-S", "./prog", "a", "h:b"], None, "escape.ssh-command"),
    ("wget", ["--use-askpass=sh", "http://x"], None, "escape.wget-exec"),
    ("wget", ["-e", "use_askpass=sh", "http://x"], None, "escape.wget-exec"),
    ("gawk", ['BEGIN { system("id") }'], None, "escape.awk-exec"),
    ("mawk", ['BEGIN { "id" | getline }'], None, "escape.awk-exec"),
    ("nice", ["ls"], None, "escape.wrapper"), ("less", ["f"], None, "escape.interactive"),
    ("python3-dbg", ["-c", "1"], None, "inline-code"), ("original-awk", ['BEGIN{system("id")}'], None,
                                                         "escape.awk-exec"),
    ("fd", ["-e", "py", "-x", "rm"], None, "escape.exec-option"), ("fd", ["--exec-batch", "rm"], None,
                                                                    "escape.exec-option"),
    ("rg", ["--pre", "sh", "x"], None, "escape.exec-option"),
]


@pytest.mark.parametrize(("cmd", "argv", "stdin", "rule"), FAMILIES)
def test_family_rules(cmd: str, argv: list[str], stdin: str | None, rule: str) -> None:
    decision = check_command(BROAD, cmd, argv, stdin=stdin)
    assert not decision.allowed and decision.rule == rule, decision


@pytest.mark.parametrize(("cmd", "argv"), [
    ("perl", ["script.pl"]), ("perl", ["-ie", "script.pl"]), ("perl", ["-Mstrict", "script.pl"]),
    ("bash", ["script.sh", "arg"]), ("ruby", ["script.rb"]), ("ssh", ["host", "ls", "-la"]),
    ("rsync", ["-av", "a/", "b/"]), ("gawk", ["{print}", "f"]), ("Rscript", ["analysis.R"]),
    ("fd", ["-e", "py", "src"]), ("rg", ["-nx", "TODO", "src"]), ("rg", ["--pre-glob", "*.gz", "x"]),
])
def test_family_scripts_allowed(cmd: str, argv: list[str]) -> None:
    assert check_command(BROAD, cmd, argv).allowed


def _lifting(**update: object) -> Policy:
    return BROAD.model_copy(update=update)


def test_lifting_named_rules() -> None:
    assert check_command(_lifting(allow_inline_code=True), "python3", ["-c", "print(1)"]).allowed
    find_exec = _lifting(allow_escapes=["find-exec"])
    assert check_command(find_exec, "find", [".", "-exec", "echo", "{}", ";"]).allowed
    assert check_command(find_exec, "find", [".", "-delete"]).rule == "escape.find-delete"
    assert check_command(find_exec, "find", [".", "-exec", "sudo", "id", ";"]).rule == "always-denied"
    assert check_command(_lifting(allow_escapes=["substitution"]), "echo", ["$(id)"]).allowed
    assert check_command(_lifting(allow_escapes=["git-config"]), "git", ["-c", "user.name=x", "log"]).allowed
    assert check_command(_lifting(allow_escapes=["git-config"]), "git", ["-c", "core.pager=x", "log"]).rule \
        == "escape.git-exec"


def test_lifted_wrapper_checks_the_wrapped_program() -> None:
    policy = _lifting(allow_escapes=["wrapper"])
    assert check_command(policy, "nice", ["-n", "5", "ls"]).rule == "commands.ls"
    assert check_command(policy, "timeout", ["-s", "KILL", "5", "ls"]).rule == "commands.ls"
    assert check_command(policy, "env", ["FOO=1", "ls"]).allowed
    assert check_command(policy, "nice", ["python3", "-c", "1"]).rule == "inline-code"
    assert check_command(policy, "nice", ["curl", "x"]).rule == "not-allowed"
    assert check_command(policy, "env", ["LD_PRELOAD=/tmp/x.so", "ls"]).rule == "escape.env"
    assert check_command(policy, "env", ["-S", "ls -l"]).rule == "escape.wrapper"  # env -S re-splits a string
    assert check_command(policy, "env", ["-iS", "ls -l"]).rule == "escape.wrapper"
    assert check_command(policy, "env", ["-a", "ls", "python3", "-c", "1"]).rule == "inline-code"  # -a NAME
    assert check_command(policy, "xargs", ["ls"]).rule == "escape.wrapper"  # args come from stdin
    assert check_command(policy, "nice", ["nice", "nice", "nice", "ls"]).rule == "escape.wrapper"
    assert check_command(policy, "nice", ["ls"], read_only=True).rule == "read-only"


def test_always_denied_can_never_be_lifted() -> None:
    with pytest.raises(ValidationError, match="always denied"):
        Policy(commands={"sudo": CommandRule()})
    with pytest.raises(ValidationError, match="unknown escape"):
        Policy(allow_escapes=["always-denied"])
    with pytest.raises(ValidationError, match="allow_inline_code"):
        Policy(allow_escapes=["inline-code"])
    everything = Policy.model_construct(  # skips validation, as a hand-built or tampered policy might
        commands={**BROAD.commands, **{n: CommandRule() for n in ALWAYS_DENIED}},
        allow_escapes=sorted(KNOWN_ESCAPES), allow_inline_code=True)
    for name in sorted(ALWAYS_DENIED):
        assert check_command(everything, name, []).rule == "always-denied"
        assert check_command(everything, "nice", [f"/usr/bin/{name}"]).rule == "always-denied"


@pytest.mark.parametrize(("cmd", "argv", "allowed"), [
    ("ls", ["-la"], True), ("cat", ["f"], True), ("grep", ["x", "f"], True), ("git", ["status"], True),
    ("git", ["log", "-p"], True), ("git", ["branch"], True), ("git", ["branch", "--list", "feat*"], True),
    ("git", ["branch", "-a", "--contains", "HEAD"], True), ("sed", ["s/a/b/", "f"], True), ("sort", ["f"], True),
    ("find", [".", "-name", "x"], True), ("date", ["-d", "yesterday"], True), ("hostname", [], True),
    ("rm", ["x"], False), ("git", ["push"], False), ("git", ["commit", "-m", "x"], False),
    ("git", ["branch", "-D", "x"], False), ("git", ["branch", "new"], False), ("git", ["log", "--output=x"], False),
    ("sed", ["-i", "s/a/b/", "f"], False), ("sed", ["-ni", "p", "f"], False), ("sed", ["--in-place", "p"], False),
    ("sort", ["-o", "out", "f"], False), ("sort", ["-uo", "out", "f"], False), ("sort", ["--output=out"], False),
    ("tee", ["x"], False), ("touch", ["x"], False), ("python3", ["s.py"], False), ("date", ["0101"], False),
    ("date", ["-s", "now"], False), ("hostname", ["evil"], False), ("file", ["-C", "-m", "x"], False),
])
def test_read_only(cmd: str, argv: list[str], allowed: bool) -> None:
    decision = check_command(DEFAULT, cmd, argv, read_only=True)
    assert decision.allowed is allowed, decision
    if not allowed:
        assert decision.rule == "read-only"


def test_read_only_refuses_lifted_escapes() -> None:
    policy = _lifting(allow_escapes=["find-delete"])
    assert check_command(policy, "find", [".", "-delete"]).allowed
    assert check_command(policy, "find", [".", "-delete"], read_only=True).rule == "read-only"


@pytest.mark.parametrize(("env", "rule"), [
    ({"LD_PRELOAD": "/tmp/x.so"}, "escape.env"), ({"PYTHONSTARTUP": "x"}, "escape.env"),
    ({"NODE_OPTIONS": "--require x"}, "escape.env"), ({"GIT_SSH_COMMAND": "sh"}, "escape.env"),
    ({"BASH_ENV": "x"}, "escape.env"), ({"PATH": "/tmp"}, "escape.env"), ({"TAR_OPTIONS": "--to-command=sh"},
                                                                         "escape.env"),
    ({"ld_preload": "x"}, "escape.env"), ({"HOME": "/tmp/evil"}, "escape.env"), ({"1BAD": "x"}, "env.invalid"),
    ({"A=B": "x"}, "env.invalid"), ({"": "x"}, "env.invalid"), ({"OK": "a\x00b"}, "env.invalid"),
    ({"CI": "1", "DEBUG": "1", "NODE_ENV": "production", "PYTHONUNBUFFERED": "1"}, "env"), (None, "env"),
])
def test_env(env: dict[str, str] | None, rule: str) -> None:
    decision = check_env(DEFAULT, env)
    assert decision.rule == rule and decision.allowed is (rule == "env"), decision


def test_env_escape_can_be_lifted() -> None:
    assert check_env(_lifting(allow_escapes=["env"]), {"LD_PRELOAD": "x"}).allowed


@pytest.mark.parametrize(("script", "effects"), [
    ("s/a/b/", set()), ("1e id", {"exec"}), ("s/x/y/e", {"exec"}), ("s/x/y/w f", {"write"}), ("w out", {"write"}),
    (r":a;N;$!ba;s/\n/ /g", set()), ("/re/I p", set()), (r"\%x%d", set()), ("1,+3d", set()), ("0~2p", set()),
    ("a\\\nsome e text", set()), ("$ a footer; e id", set()), ("y/abc/xyz/", set()), ("s/a/b/q", {"unparsed"}),
    ("k", {"unparsed"}), ("/x/{s/a/b/;e id\n}", {"exec"}), ("s/a", {"unparsed"}), ("# e id\np", set()),
])
def test_sed_script_effects(script: str, effects: set[str]) -> None:
    assert sed_effects(script) == effects


NAMES = sorted(BROAD.commands)
TEXT = st.text(st.characters(blacklist_characters="\x00"), max_size=20)


@given(cmd=st.sampled_from(NAMES), before=st.lists(TEXT, max_size=3), after=st.lists(TEXT, max_size=3),
       left=TEXT, right=TEXT, marker=st.sampled_from(["$(", "`"]))
def test_any_substitution_in_argv_is_denied(cmd: str, before: list[str], after: list[str], left: str, right: str,
                                            marker: str) -> None:
    decision = check_command(BROAD, cmd, [*before, left + marker + right, *after])
    assert not decision.allowed


@given(wrapper=st.sampled_from(sorted(WRAPPERS)), denied=st.sampled_from(sorted(ALWAYS_DENIED)),
       prefix=st.sampled_from(["", "/usr/bin/", "/sbin/"]), before=st.lists(TEXT, max_size=3),
       after=st.lists(TEXT, max_size=3))
def test_wrapped_always_denied_is_denied_even_with_everything_lifted(
        wrapper: str, denied: str, prefix: str, before: list[str], after: list[str]) -> None:
    everything = Policy.model_construct(commands={**BROAD.commands, **{w: CommandRule() for w in WRAPPERS}},
                                        allow_escapes=sorted(KNOWN_ESCAPES), allow_inline_code=True)
    assert check_command(everything, wrapper, [*before, prefix + denied, *after]).rule == "always-denied"


@given(flags=st.text(alphabet="bBdEhiIOqsSuvx", max_size=5), code=TEXT)
def test_python_combined_flags_ending_in_c_are_inline_code(flags: str, code: str) -> None:
    decision = check_command(DEFAULT, "python3", [f"-{flags}c", code])
    assert decision.rule in ("inline-code", "escape.substitution", "always-denied")


@settings(max_examples=300)
@given(cmd=st.sampled_from(NAMES), argv=st.lists(st.text(max_size=30), max_size=6), stdin=st.none() | TEXT,
       read_only=st.booleans())
def test_check_command_never_raises(cmd: str, argv: list[str], stdin: str | None, read_only: bool) -> None:
    decision = check_command(BROAD, cmd, argv, stdin=stdin, read_only=read_only)
    assert decision.rule and decision.reason


# ---------------------------------------------------------------- loading


def test_load_policy_merges_with_the_defaults(tmp_path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("""
commands:
  jq: {read_only: true}
  git: {subcommands: [status, log]}
  python3: null
allow_escapes: [find-exec]
max_output_bytes: 1000
read_roots: [/srv/data]
""")
    policy = load_policy(path)
    assert policy.max_output_bytes == 1000 and policy.read_roots == ["/srv/data"]
    assert check_command(policy, "jq", [".x"], read_only=True).allowed
    assert check_command(policy, "ls", []).allowed  # kept from the defaults
    assert check_command(policy, "git", ["push"]).rule == "subcommand"
    assert check_command(policy, "python3", ["s.py"]).rule == "not-allowed"
    assert check_command(policy, "find", [".", "-exec", "echo", "{}", ";"]).allowed


def test_load_policy_replace_commands(tmp_path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("replace_commands: true\ncommands:\n  ls: {read_only: true}\n")
    policy = load_policy(path)
    assert list(policy.commands) == ["ls"]
    assert check_command(policy, "cat", ["f"]).rule == "not-allowed"


def test_load_policy_defaults(tmp_path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_policy(None) == default_policy() == load_policy(empty)
    assert policy_from_mapping({}) == default_policy()


@pytest.mark.parametrize(("text", "expected"), [
    ("commands: [unclosed", "not valid YAML"), ("comands: {}", "unknown key 'comands'"),
    ("commands:\n  git: {deny_arg: [x]}", "unknown key 'commands.git.deny_arg'"),
    ("max_output_bytes: lots", "'max_output_bytes'"), ("commands:\n  sudo: {}", "always denied"),
    ("allow_escapes: [find-exce]", "unknown escape 'find-exce'"), ("- a list", "must be a mapping"),
    ("commands: [ls]", "'commands' must map"), ("replace_commands: maybe", "replace_commands"),
    ("commands:\n  bin/ls: {}", "not a program name"),
])
def test_load_policy_bad_input_names_file_and_key(tmp_path, text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"bad\.yaml") as info:
        load_policy(path)
    assert expected in str(info.value)


def test_load_policy_missing_file(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"nope\.yaml"):
        load_policy(tmp_path / "nope.yaml")
