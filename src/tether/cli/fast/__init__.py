"""The fast path of `tether device` and `tether exec`: their command line parsed here, without typer's parsing,
and the command's body run directly (`setup/device_run.py`, `fleet/exec_run.py`), importing neither typer nor
click (`tether exec --device`/`--all` import what their views need, typer included, only when they run).

The options come from `spec.COMMANDS`, which `gen.py` generates from the typer app (a test fails when the
two differ). `run_fast(args)` handles only what it parses exactly as typer would, giving the command's
function the same values: `--opt VALUE`, `--opt=VALUE`, `-o VALUE`, `-oVALUE`, flags, repeated options,
arguments anywhere (after the options for a group), `--`, the options' environment variables and
defaults, and values of the simple forms of their types. Anything else, `-h`/`--help` included, a
sub-command, an unknown option, a missing or malformed value or a missing argument, returns without
doing anything, and typer parses the command line as before: its help, its usage errors and their exit
codes stay the only ones.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import Any

_INT = re.compile(r"0|[1-9][0-9]{0,17}")  # typer (pydantic) takes more forms; those fall back to it
_FLOAT = re.compile(r"(0|[1-9][0-9]{0,17})(\.[0-9]{1,17})?")


def _value(option: dict[str, Any], raw: str) -> Any:
    """`raw` as the option's type; None where the fast path does not take it (typer decides)."""
    try:
        raw.encode("utf-8")  # undecodable bytes of the command line (surrogate escapes): typer's case
    except UnicodeEncodeError:
        return None
    kind = option.get("type", "text")
    if kind == "text":
        return raw
    if kind == "path":
        from pathlib import Path

        return Path(raw) if raw else None
    if not (_INT if kind == "int" else _FLOAT).fullmatch(raw):
        return None
    number = int(raw) if kind == "int" else float(raw)
    low, high = option.get("min"), option.get("max")
    if (low is not None and number < low) or (high is not None and number > high):
        return None
    return number


def parse(entry: dict[str, Any], args: list[str], environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The keyword arguments typer would call the command's function with for `args` (the words after the
    command's name), from its `spec.COMMANDS` entry; None when the fast path leaves `args` to typer."""
    by_opt = {opt: option for option in entry["options"] for opt in option["opts"]}
    given: dict[str, Any] = {}
    words: list[str] = []
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if arg == "--":
            words.extend(rest)
            break
        if arg in ("-h", "--help"):
            return None
        if not arg.startswith("-") or arg == "-":
            if entry["group"]:
                return None  # a sub-command's name
            words.append(arg)
            continue
        if arg.startswith("--"):
            opt, eq, attached = arg.partition("=")
            raw: str | None = attached if eq else None
        else:  # -o VALUE or -oVALUE
            opt, attached = arg[:2], arg[2:]
            if "=" in arg:
                return None
            raw = attached or None
        option = by_opt.get(opt)
        if option is None:
            return None
        if option.get("flag"):
            if raw is not None:
                return None
            given[option["name"]] = True
            continue
        if raw is None:
            if not rest:
                return None
            raw = rest.pop(0)
        value = _value(option, raw)
        if value is None:
            return None
        if option.get("multiple"):
            given.setdefault(option["name"], []).append(value)
        else:
            given[option["name"]] = value
    if entry["group"] and words:
        return None
    out: dict[str, Any] = {}
    for option in entry["options"]:
        name = option["name"]
        if name in given:
            out[name] = given[name]
        elif option.get("flag"):
            out[name] = False
        elif option.get("envvar") and environ.get(option["envvar"]):
            value = _value(option, environ[option["envvar"]])
            if value is None:
                return None
            out[name] = value
        else:
            out[name] = option.get("default")
    for argument in entry["arguments"]:
        if argument.get("many"):
            out[argument["name"]], words = (words or None), []
        elif words:
            out[argument["name"]] = words.pop(0)
        elif argument.get("required"):
            return None
        else:
            out[argument["name"]] = None
    return None if words else out


def _completing(environ: Mapping[str, str]) -> bool:
    """A shell's completion request (`_TETHER_COMPLETE=…`): typer answers it."""
    return any(key.startswith("_") and key.endswith("_COMPLETE") for key in environ)


def run_fast(argv: list[str]) -> None:
    """Run `tether ARGV` when it is a command line the fast path handles, then exit with the command's code;
    otherwise return at once, having done nothing."""
    if not argv or argv[0] not in ("device", "exec") or _completing(os.environ):
        return
    from tether.cli.fast.spec import COMMANDS

    kwargs = parse(COMMANDS[argv[0]], argv[1:], os.environ)
    if kwargs is None:
        return
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if argv[0] == "device":
            from tether.cli.commands.setup.device_run import run_device, take_device_token_from_env

            code = run_device(take_device_token_from_env(), **kwargs)
        else:
            from tether.cli.commands.fleet.exec_run import run_exec

            run_exec(**kwargs)
            code = 0
    except KeyboardInterrupt:  # as typer ends an interrupted command
        code = 130
    except EOFError:
        print("\nAborted.", file=sys.stderr)
        code = 1
    except BrokenPipeError:  # the reader of its output went away (`| head`): quietly, as click does
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (nothing more is written; no flush error)
        code = 1
    except Exception as exc:
        clicked = _click_exit(exc)
        if clicked is None:
            from tether.cli.guards.unhandled import report_unhandled

            report_unhandled(exc)
            raise
        code = clicked
    sys.exit(code)


def _click_exit(exc: Exception) -> int | None:
    """The exit code typer's own handling gives `exc` when it is one of its exceptions (a module of the
    command that uses typer raised it: `typer.Exit`, a usage error, `Abort`), its message shown as typer
    shows it; None for any other exception."""
    if "typer" not in sys.modules:
        return None
    from typer import Abort, Exit
    from typer._click.exceptions import ClickException

    if isinstance(exc, Exit):
        return int(exc.exit_code)
    if isinstance(exc, ClickException):
        exc.show()
        return int(exc.exit_code)
    if isinstance(exc, Abort):
        print("Aborted.", file=sys.stderr)
        return 1
    return None
