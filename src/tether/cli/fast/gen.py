"""The fast path's table of options (`tether.cli.fast.spec`) and the root help's drawing (`help_data`), generated
from the typer app, so that they cannot differ: `python -m tether.cli.fast.gen` rewrites both
(tests/cli/test_fast_path.py fails while `spec.py` is not what this writes, or while `tether --help` drawn
from `help_data` is not what typer draws, at several widths and with colour).

Each hot command's entry lists its options (python name, option strings, flag or value, repeatable,
value type, bounds, environment variable, default) and its arguments, and says whether it is a group
(whose first word that is not an option names a sub-command: the fast path leaves it to typer). A
parameter of a kind the fast parser does not handle (a choice, a `--x/--no-x` pair, a count, a value
that is not text, a path or a number) is refused here, naming it, so the table never describes less
than the command takes.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

HOT = {"device": "setup.device", "exec": "fleet.tools"}  # the commands with a fast path, and their typer module
TARGET = Path(__file__).with_name("spec.py")
HELP_TARGET = Path(__file__).with_name("help_data.py")
WIDTHS = range(16, 321)  # terminal widths the root help is recorded at; wider ones draw as the widest


def _kind(param: Any) -> tuple[str, Any, Any]:
    """The value type of a typer parameter ("text", "path", "int", "float": the annotation, a list's item, an
    optional's value) and its bounds (None for none)."""
    import typing
    from pathlib import PurePath

    annotation = param.type_descriptor.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, __import__("types").UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is list:
        [annotation] = typing.get_args(annotation)
    info = param.type_descriptor.parameter_info
    if param.type_descriptor.is_choice or param.type_descriptor.is_file or any(
            getattr(info, attr, None) for attr in ("clamp", "min_open", "max_open", "callback", "parser",
                                                   "click_type")):
        raise ValueError(f"{param.name}: a choice, a file, a clamped range, a callback or a parser is not handled "
                         "by the fast path")
    low, high = getattr(info, "min", None), getattr(info, "max", None)
    if annotation is str and low is None and high is None:
        return "text", None, None
    if isinstance(annotation, type) and issubclass(annotation, PurePath) and annotation is Path:
        return "path", None, None
    if annotation in (int, float):
        return annotation.__name__, low, high
    raise ValueError(f"{param.name}: type {annotation!r} is not handled by the fast path")


def describe(command: Any) -> dict[str, Any]:
    """The fast path's entry for one click command (as typer builds it). ValueError names a parameter the
    fast path does not handle."""
    from typer.core import TyperArgument

    options: list[dict[str, Any]] = []
    arguments: list[dict[str, Any]] = []
    for param in command.params:
        if isinstance(param, TyperArgument):
            if param.envvar or param.nargs not in (1, -1):
                raise ValueError(f"{param.name}: an argument with an environment variable or nargs "
                                 f"{param.nargs} is not handled by the fast path")
            arguments.append({"name": param.name, "many": param.nargs == -1, "required": param.required})
            continue
        if param.secondary_opts or param.count or param.is_eager or param.nargs != 1 or param.callback is not None:
            raise ValueError(f"{param.name}: a --x/--no-x pair, a count, an eager option, nargs or a callback is "
                             "not handled by the fast path")
        if param.is_flag:
            if param.default is not False or param.envvar or param.multiple:
                raise ValueError(f"{param.name}: a flag that is not off by default is not handled by the fast path")
            options.append({"name": param.name, "opts": sorted(param.opts), "flag": True})
            continue
        kind, low, high = _kind(param)
        if isinstance(param.envvar, list | tuple) or (param.multiple and (param.envvar or param.default)):
            raise ValueError(f"{param.name}: several environment variables, or a repeatable option with one or a "
                             "default, are not handled by the fast path")
        default = param.default
        if not (default is None or isinstance(default, str | int | float)):
            raise ValueError(f"{param.name}: default {default!r} is not handled by the fast path")
        options.append({"name": param.name, "opts": sorted(param.opts), "flag": False, "multiple": param.multiple,
                        "type": kind, "min": low, "max": high, "envvar": param.envvar, "default": default})
    return {"group": hasattr(command, "commands"), "options": options, "arguments": arguments}


def build() -> dict[str, dict[str, Any]]:
    """Every hot command's entry, from the typer app with the hot commands' modules imported."""
    import typer

    from tether.cli.common import app

    for module in HOT.values():
        importlib.import_module(f"tether.cli.commands.{module}")
    root = typer.main.get_command(app)
    return {name: describe(root.commands[name]) for name in HOT}  # type: ignore[attr-defined]


OMITTED = {"flag": False, "multiple": False, "type": "text", "min": None, "max": None, "envvar": None, "default": None,
           "many": False, "required": False}  # what a parameter's entry leaves out: the parser reads these defaults


def _short(item: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in item.items() if key not in OMITTED or OMITTED[key] != value}


def render(spec: dict[str, dict[str, Any]]) -> str:
    """`spec.py`'s text for `spec`: one line per parameter."""
    lines = ['"""Generated by `python -m tether.cli.fast.gen` from the typer app: the parameters of the commands',
             'with a fast path (`tether.cli.fast`). Do not edit by hand."""', "", "from typing import Any", "",
             "COMMANDS: dict[str, dict[str, Any]] = {"]
    for name, entry in spec.items():
        lines.append(f"    {name!r}: {{")
        lines.append(f"        'group': {entry['group']!r},")
        for part in ("arguments", "options"):
            lines.append(f"        {part!r}: [")
            lines.extend(f"            {_short(item)!r}," for item in entry[part])
            lines.append("        ],")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def build_help() -> dict[str, Any]:
    """What typer prints for `tether --help`: the objects handed to its console's `print` and their keyword
    arguments, pickled, for every width in `WIDTHS` where they differ (tether's option panels are laid out
    by the width), with the console's theme, its highlighter's patterns and the usage line after the
    program's name."""
    import base64
    import contextlib
    import io
    import os
    import pickle

    from rich.console import Console

    from tether.cli.views.rich_help import load_rich_utils

    load_rich_utils()
    import typer.rich_utils as rich_utils

    from tether.cli.common import app

    recorded: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class Recording(Console):
        def print(self, *objects: Any, **kwargs: Any) -> None:
            if any(isinstance(o, str) for o in objects):
                raise ValueError("typer printed a string in the root help: the recording cannot highlight it")
            recorded.append((objects, kwargs))

    original = rich_utils._get_rich_console

    def recording_console(stderr: bool = False) -> Console:
        console = original(stderr)
        console.__class__ = Recording
        return console

    variants: list[tuple[int, str]] = []  # (first width, pickled calls)
    saved = os.environ.get("COLUMNS")
    rich_utils._get_rich_console = recording_console
    try:
        for width in WIDTHS:
            recorded.clear()
            os.environ["COLUMNS"] = str(width)
            with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
                app(["--help"], prog_name="tether")
            usage = recorded[0][0][0].renderable.plain
            data = base64.b64encode(pickle.dumps(recorded, protocol=5)).decode()
            if not variants or variants[-1][1] != data:
                variants.append((width, data))
    finally:
        rich_utils._get_rich_console = original
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    console = original(False)
    theme = {name: str(style) for name, style in console._theme_stack._entries[-1].items()
             if name in ("option", "switch", "negative_option", "negative_switch", "types", "types_sep", "usage")}
    from importlib.metadata import version

    return {"versions": {name: version(name) for name in ("rich", "typer")}, "variants": variants,
            "theme": theme, "highlights": list(rich_utils.OptionHighlighter.highlights),
            "usage": usage.removeprefix("Usage: tether ")}


def render_help(data: dict[str, Any]) -> str:
    """`help_data.py`'s text for `data`."""
    lines = ['"""Generated by `python -m tether.cli.fast.gen` from the typer app: what typer prints for',
             '`tether --help` (pickled rich objects, base64, per range of widths), for `tether.cli.fast.help`. Do not',
             'edit by hand."""',
             "", "THEME = {", *(f"    {k!r}: {v!r}," for k, v in data["theme"].items()), "}",
             "HIGHLIGHTS = [", *(f"    {h!r}," for h in data["highlights"]), "]", f"USAGE = {data['usage']!r}",
             f"VERSIONS = {data['versions']!r}  # of the libraries that drew it: others draw with typer",
             "VARIANTS = ["]
    for width, blob in data["variants"]:
        lines.append(f"    ({width}, (")
        lines.extend(f"        {blob[i:i + 100]!r}" for i in range(0, len(blob), 100))
        lines.append("    )),")
    lines.append("]")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    TARGET.write_text(render(build()))
    HELP_TARGET.write_text(render_help(build_help()))
    print(f"wrote {TARGET} and {HELP_TARGET}")
