"""Arguments that carry code: interpreter options (`python -c`, `perl -e`...), awk programs, sed scripts.

Allowing `python3` to run a script file is a choice the policy makes; letting `-c`, stdin or an
awk `system()` slip an arbitrary program through an allowed name is not. These checkers read the
option syntax the way each program does (combined short flags, attached values, where option
parsing stops) and report what they cannot rule out: unknown means denied.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

_STDIN_PATH = re.compile(r"-|/dev/(stdin|fd/0)|/proc/(self|thread-self|\d+)(/task/\d+)?/fd/0")


def names_stdin(path: str | None) -> bool:
    """Whether a script path is really stdin (`-`, /dev/stdin, /proc/self/fd/../fd/0, ...)."""
    return path is not None and bool(_STDIN_PATH.fullmatch(posixpath.normpath(path) if path != "-" else path))


class Finding(NamedTuple):
    """One reason to refuse; `payload` is text that would be run as a command or code."""

    rule: str
    reason: str
    payload: tuple[str, ...] = ()


Checker = Callable[[list[str], str | None], list[Finding]]

# ---------------------------------------------------------------- option parsing helpers


def long_opt(arg: str) -> tuple[str, str | None] | None:
    """`--name=value` → (name, value); `--name` → (name, None); anything else → None."""
    if not arg.startswith("--") or arg == "--":
        return None
    name, eq, value = arg[2:].partition("=")
    return name, (value if eq else None)


def is_long(arg: str, *names: str, exact: Iterable[str] = ()) -> bool:
    """`--X[=v]` where X is one of `names` or an abbreviation of one (getopt_long accepts unique prefixes).

    `exact` lists real, harmless options that happen to be prefixes of a dangerous one (tar's
    `--checkpoint` against `--checkpoint-action`)."""
    parsed = long_opt(arg)
    if parsed is None or not parsed[0]:
        return False
    name = parsed[0].lower()
    return name not in exact and any(n.startswith(name) for n in names)


def value_of(args: list[str], i: int) -> str:
    """The value of the option at `args[i]`: attached after `=`, else the next argument."""
    parsed = long_opt(args[i])
    if parsed and parsed[1] is not None:
        return parsed[1]
    return args[i + 1] if i + 1 < len(args) else ""


def cluster(arg: str, with_value: str = "") -> list[tuple[str, str]]:
    """Letters of a `-abc` cluster in order; a letter in `with_value` takes the rest as its value."""
    if len(arg) < 2 or arg[0] != "-" or arg[1] == "-":
        return []
    out: list[tuple[str, str]] = []
    for j in range(1, len(arg)):
        if arg[j] in with_value:
            out.append((arg[j], arg[j + 1:]))
            break
        out.append((arg[j], ""))
    return out


def letters(arg: str, with_value: str = "") -> str:
    return "".join(ch for ch, _ in cluster(arg, with_value))


# ---------------------------------------------------------------- interpreters

EVAL_MODULES = frozenset({"timeit", "pdb", "code", "codeop", "idlelib", "cprofile", "profile", "trace",
                          "runpy", "asyncio", "ipython", "ptpython", "bdb", "doctest"})
_PERL_MODULE = re.compile(r"-?[\w:]+(=[\w:,.\-]*)?")


def _code(reason: str, *payload: str) -> Finding:
    return Finding("inline-code", reason, payload)


def _stdin_script(prog: str, script: str | None, stdin: str | None) -> list[Finding]:
    if names_stdin(script):
        return [_code(f"{prog} would read its program from stdin ({script!r})", stdin or "")]
    if script is None and stdin is not None:
        return [_code(f"{prog} with stdin and no script file would run stdin as code", stdin)]
    return []


def check_python(args: list[str], stdin: str | None) -> list[Finding]:
    found: list[Finding] = []
    i, script, terminated = 0, None, False
    while i < len(args) and not terminated:
        arg = args[i]
        if arg == "--":
            script = args[i + 1] if i + 1 < len(args) else None
            break
        if arg.startswith("--"):
            i += 2 if arg == "--check-hash-based-pycs" else 1
            continue
        if not arg.startswith("-") or arg == "-":
            script = arg
            break
        for ch, attached in cluster(arg, "cmWX"):
            value = attached or (args[i + 1] if i + 1 < len(args) else "")
            if ch in "cmWX" and not attached:
                i += 1
            if ch == "c":
                found.append(_code("python -c runs inline code", value))
            elif ch == "m" and value.split(".")[0].lower() in EVAL_MODULES:
                found.append(_code(f"python -m {value} evaluates code from its arguments or stdin", *args))
            elif ch == "i":
                found.append(_code("python -i reads code from stdin after the script", stdin or ""))
            terminated = terminated or ch in "cm"
        i += 1
    return found if terminated else found + _stdin_script("python", script, stdin)


def check_perl(args: list[str], stdin: str | None) -> list[Finding]:
    found: list[Finding] = []
    i, script, has_code = 0, None, False
    while i < len(args):
        arg = args[i]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            script = args[i + 1] if arg == "--" and i + 1 < len(args) else (None if arg == "--" else arg)
            break
        for ch, attached in cluster(arg, "eEIMmixF"):
            if ch in "eEI" and not attached:
                i += 1
                attached = args[i] if i < len(args) else ""
            if ch in "eE":
                has_code = True
                found.append(_code(f"perl -{ch} runs inline code", attached))
            elif ch == "d":
                found.append(_code("perl -d starts the debugger, which runs code it reads", stdin or ""))
            elif ch in "Mm" and not _PERL_MODULE.fullmatch(attached):
                found.append(_code(f"perl -{ch}{attached} injects code into a `use` statement", attached))
        i += 1
    return found if has_code else found + _stdin_script("perl", script, stdin)


def _long_name(arg: str) -> str:
    parsed = long_opt(arg)
    return parsed[0].lower() if parsed else ""


def _anywhere(prog: str, args: list[str], stdin: str | None, short: str, long: tuple[str, ...]) -> list[Finding]:
    """Interpreters whose options we do not model fully: inline-code markers anywhere are refused."""
    found = [_code(f"{prog} {a} runs inline code or reads code interactively", *args) for a in args
             if (len(a) > 1 and a[0] in "-+" and a[1] != "-" and set(a[1:]) & set(short))
             or (_long_name(a) and any(n.startswith(_long_name(a)) for n in long))]
    first = args[0] if args else None
    if names_stdin(first) or (stdin is not None and (first is None or first.startswith("-"))):
        found.append(_code(f"{prog} would run code from stdin; give a script file as the first argument",
                           stdin or ""))
    return found


def check_node(args: list[str], stdin: str | None) -> list[Finding]:
    found = _anywhere("node", args, stdin, "epi", ("eval", "print", "interactive", "run"))
    found += [_code("node would load code from a data: URL", a) for a in args if "data:" in a]
    found += [Finding("escape.debugger", "node --inspect opens a debugger port that runs any code")
              for a in args if _long_name(a).startswith(("inspect", "debug"))]
    found += [Finding("escape.env", "node --env-file can set NODE_OPTIONS (code to preload)")
              for a in args if a.startswith("--env-file")]
    return found


def check_generic(args: list[str], stdin: str | None) -> list[Finding]:
    """Interpreters tether does not model: only `PROG script args...` is let through."""
    head = next((i for i, a in enumerate(args) if not a.startswith("-")), len(args))
    found = [_code(f"tether does not model this interpreter's option {a}; run a script file without options",
                   *args) for a in args[:head] if a not in ("--version", "--help")]
    if head < len(args) and (args[head].lower() in ("eval", "repl", "e") or names_stdin(args[head])):
        found.append(_code(f"'{args[head]}' makes this interpreter evaluate code", *args))
    if head == len(args) and stdin is not None:
        found.append(_code("with stdin and no script file this interpreter would run stdin as code", stdin))
    return found


INTERPRETERS: dict[str, Checker] = {
    "python": check_python,
    "perl": check_perl,
    "node": check_node,
    "ruby": lambda a, s: _anywhere("ruby", a, s, "e", ("eval",)),
    "php": lambda a, s: _anywhere("php", a, s, "rRBEaFdz", ("run", "process-begin", "process-code",
                                                             "process-end", "interactive", "define",
                                                             "zend-extension")),
    "lua": lambda a, s: _anywhere("lua", a, s, "ei", ()),
    "shell": lambda a, s: _anywhere("the shell", a, s, "csiC", ("command", "init-command")),
    "interpreter": check_generic,
}


# ---------------------------------------------------------------- awk and sed: programs in an argument

_AWK_UNSAFE_W = ("exec", "file", "include", "load", "debug")


def check_awk(args: list[str], stdin: str | None) -> list[Finding]:
    found: list[Finding] = []
    for i, arg in enumerate(args):
        if is_long(arg, *_AWK_UNSAFE_W):
            found.append(Finding("escape.awk-exec", f"awk {arg} loads a program or library tether cannot check"))
        for ch, attached in cluster(arg, "fFvWeEilDLopd"):
            value = (attached or (args[i + 1] if i + 1 < len(args) else "")).split("=")[0].lower()
            if ch in "fEilD" or (ch == "W" and (not value or any(u.startswith(value) for u in _AWK_UNSAFE_W))):
                found.append(Finding("escape.awk-exec", f"awk -{ch} loads a program or library tether cannot check"))
    text = "\n".join(args).replace("\\\n", "")
    pipes = [m.start() for m in re.finditer(r"(?<!\|)\|(?!\|)", text)]
    printed = [m.start() for m in re.finditer(r"\bprintf?\b", text, re.I)]
    getlines = [m.start() for m in re.finditer(r"\bgetline\b", text, re.I)]
    if re.search(r"\bsystem\b", text, re.I):
        found.append(Finding("escape.awk-exec", "the awk program calls system()", (text,)))
    if "|&" in text or any((printed and printed[0] < p) or (getlines and getlines[-1] > p) for p in pipes):
        found.append(Finding("escape.awk-exec", "the awk program pipes to or from a command (print | cmd, "
                             "cmd | getline); for regex alternation use grep -E", (text,)))
    if re.search(r"@\s*[A-Za-z_]", text):
        found.append(Finding("escape.awk-exec", "gawk @-directives and indirect calls (@f()) can reach system(); "
                             "pass text containing '@' with -v"))
    if "/inet" in text:
        found.append(Finding("escape.awk-exec", "gawk /inet special files open network connections"))
    return found


def sed_args(args: list[str]) -> tuple[list[str], bool, bool]:
    """(scripts, in_place, script_from_file) of a sed command line (GNU getopt: options may follow files)."""
    scripts: list[str] = []
    positional: list[str] = []
    in_place = from_file = explicit = False
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            positional += args[i + 1:]
            break
        if long_opt(arg):
            takes = is_long(arg, "expression", "file", "line-length") and "=" not in arg
            if is_long(arg, "expression"):
                scripts.append(value_of(args, i))
                explicit = True
            from_file = from_file or is_long(arg, "file")
            in_place = in_place or is_long(arg, "in-place")
            i += 2 if takes else 1
            continue
        if arg.startswith("-") and len(arg) > 1:
            step = 1
            for ch, attached in cluster(arg, "efli"):
                in_place = in_place or ch == "i"
                if ch in "efl":
                    value = attached or (args[i + 1] if i + 1 < len(args) else "")
                    step = 1 if attached else 2
                    scripts += [value] if ch == "e" else []
                    explicit = explicit or ch == "e"
                    from_file = from_file or ch == "f"
            i += step
            continue
        positional.append(arg)
        i += 1
    if not explicit and positional:
        scripts.append(positional[0])
        if in_place and positional[0] == "" and len(positional) > 1:  # BSD `sed -i '' SCRIPT FILE`
            scripts.append(positional[1])
    return scripts, in_place, from_file


def sed_effects(script: str) -> set[str]:
    """What a GNU sed script can do beyond editing text: {"exec", "write", "unparsed"}.

    A small parser of sed's grammar (addresses, `!`, commands and their arguments) written to
    follow GNU sed's own reading, e.g. delimiters end at the first unescaped delimiter even inside
    `[...]`. Anything it does not recognise is "unparsed", which the caller treats as unsafe.
    """
    s, n, i = script, len(script), 0
    effects: set[str] = set()

    def until(k: int, stops: str) -> int:
        while k < n and s[k] not in stops:
            k += 1
        return k

    def delimited(k: int, delim: str) -> int:
        while k < n:
            if s[k] == "\\":
                k += 2
            elif s[k] == delim:
                return k + 1
            elif s[k] == "\n":
                return -1
            else:
                k += 1
        return -1

    def address(k: int) -> int:
        if k < n and (s[k].isdigit() or s[k] in "+~"):
            k += 1
            while k < n and (s[k].isdigit() or s[k] == "~"):
                k += 1
        elif k < n and s[k] == "$":
            k += 1
        elif k < n and s[k] in "/\\":
            if s[k] == "\\":
                k += 1
            if k >= n:
                return -1
            k = delimited(k + 1, s[k])
            while 0 <= k < n and s[k] in "IM":
                k += 1
        return k

    while i < n:
        if s[i] in " \t\n;":
            i += 1
            continue
        i = address(i)
        if 0 <= i < n and s[i] == ",":
            i += 1
            while i < n and s[i] in " \t":
                i += 1
            i = address(i)
        if i < 0:
            return effects | {"unparsed"}
        while i < n and s[i] in " \t!":
            i += 1
        if i >= n:
            return effects | {"unparsed"}
        c, i = s[i], i + 1
        if c in "{}=dDgGhHnNpPxzF":
            continue
        if c in "lLqQ":
            while i < n and (s[i] in " \t" or s[i].isdigit()):
                i += 1
        elif c in "#:btTv":
            i = until(i, "\n" if c == "#" else "\n;")
        elif c in "aic":
            i = until(i, "\\\n")
            if s[i:i + 2] == "\\\n":
                i += 2
            while i < n and s[i] != "\n":
                i += 2 if s[i] == "\\" else 1
        elif c in "rRwWe":
            effects |= {"write"} if c in "wW" else {"exec"} if c == "e" else set()
            i = until(i, "\n")
        elif c in "sy":
            if i >= n or s[i] in "\n\\":
                return effects | {"unparsed"}
            i = delimited(i + 1, s[i])
            i = delimited(i, s[i - 1]) if i > 0 else -1
            if i < 0:
                return effects | {"unparsed"}
            while c == "s" and i < n and s[i] not in ";\n}":
                if s[i] == "w":
                    effects.add("write")
                    i = until(i, "\n")
                    break
                if s[i] == "e":
                    effects.add("exec")
                elif s[i] not in "gpiImM0123456789 \t":
                    return effects | {"unparsed"}
                i += 1
        else:
            return effects | {"unparsed"}
    return effects


def check_sed(args: list[str], stdin: str | None) -> list[Finding]:
    scripts, _, from_file = sed_args(args)
    effects = sed_effects("\n".join(scripts))
    found = [Finding("escape.sed-exec", "sed -f reads a script tether cannot check; pass it with -e")] * from_file
    if "exec" in effects:
        found.append(Finding("escape.sed-exec", "the sed script runs a command (e, or the s///e flag)", tuple(scripts)))
    if "unparsed" in effects:
        found.append(Finding("escape.sed-exec", "tether cannot parse this sed script, so it cannot rule out the "
                             "e command", tuple(scripts)))
    if "write" in effects:
        found.append(Finding("escape.sed-write", "the sed script writes a file (w/W, or the s///w flag)"))
    return found


CODE_CHECKS: dict[str, Checker] = {**INTERPRETERS, "awk": check_awk, "sed": check_sed}
