"""typer's help and error panels without rich's Markdown and traceback modules, so `tether --help` starts fast.

typer 0.29's `typer.rich_utils`, which draws every help screen and usage error, imports `rich.markdown`
(markdown-it and pygments) and `rich.traceback` at its top: for help written in Markdown
(`rich_markup_mode="markdown"`) and for pretty tracebacks. tether's help is rich markup and its errors are one
line, so printing help needs neither. typer has no switch for this: `TYPER_USE_RICH=0` or
`rich_markup_mode=None` drop the panels themselves.

`load_rich_utils()` imports `typer.rich_utils` with a stand-in for each of those two names: a class that
imports the real one the first time it is used (an instance made, a class attribute read, such as
`Traceback.from_exception`), so typer behaves as before if it ever needs them. The stand-in modules are in
`sys.modules` only while `typer.rich_utils` is imported: a later `import rich.markdown` gets the real one.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rich.text import Text

if TYPE_CHECKING:
    from rich.console import Console

DEFERRED = (("rich.markdown", "Markdown"), ("rich.traceback", "Traceback"))


def load_rich_utils() -> None:
    """Import `typer.rich_utils` without `rich.markdown` and `rich.traceback` (a no-op once it is imported)."""
    if "typer.rich_utils" in sys.modules:
        return
    placed: dict[str, types.ModuleType] = {}
    for module, name in DEFERRED:
        if module not in sys.modules:
            stand_in = types.ModuleType(module, f"stands in for {module} while typer.rich_utils is imported")
            setattr(stand_in, name, _deferred(module, name))
            placed[module] = stand_in
    sys.modules.update(placed)
    try:
        importlib.import_module("typer.rich_utils")
    finally:
        for module, stand_in in placed.items():
            if sys.modules.get(module) is stand_in:
                del sys.modules[module]


class _Deferred(type):
    """The metaclass of a stand-in: an attribute the stand-in class lacks is read from the real class."""

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__"):  # typing's and inspect's probes (__origin__, …) must not import anything
            raise AttributeError(attr)
        return getattr(cls.real(), attr)


def _deferred(module: str, name: str) -> type:
    def real(cls: type) -> type:
        return getattr(importlib.import_module(module), name)

    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        return real(cls)(*args, **kwargs)  # an instance of the real class (so the stand-in's __init__ is skipped)

    return _Deferred(name, (), {"real": classmethod(real), "__new__": new, "__module__": module,
                                "__doc__": f"imports {module}.{name} when first used"})


@contextlib.contextmanager
def narrow_options() -> Iterator[None]:
    """While it is open, typer's help screens draw their option panels with `print_options_panel`: option
    names never cut or wrapped at any terminal width. typer has no hook for this, so its module function
    is swapped for the duration of one help screen and put back after."""
    load_rich_utils()
    import typer.rich_utils as rich_utils

    original = rich_utils._print_options_panel
    rich_utils._print_options_panel = print_options_panel
    try:
        yield
    finally:
        rich_utils._print_options_panel = original


def print_options_panel(*, name: str, params: list[Any], ctx: Any, markup_mode: Any, console: Console) -> None:
    """One panel of options or arguments, as typer draws it but fitted to the terminal: each option's
    names whole (`-c, --config FILE`, `--allow-insecure / --no-allow-insecure`) and its help (with its
    default and environment variable) in a column beside them; when the longest names take more than
    two fifths of the width, each help goes on the lines below its names, indented."""
    import typer.rich_utils as rich_utils
    from rich.panel import Panel
    from rich.table import Table

    rows: list[tuple[Text, Text]] = []
    for param in params:
        names = _names(param, ctx, rich_utils)
        helped = rich_utils._get_parameter_help(param=param, ctx=ctx, markup_mode=markup_mode)
        parts = [r if isinstance(r, Text) else Text(str(r)) for r in helped.renderables]
        rows.append((names, Text(" ").join(parts)))
    if not rows:
        return
    inner = console.width - 4  # the panel's border and padding
    longest = max(n.cell_len for n, _ in rows)
    table = Table(show_header=False, box=None, expand=True, pad_edge=False, padding=(0, 1))
    if longest * 5 <= inner * 2:
        table.add_column(no_wrap=True, min_width=longest)
        table.add_column(ratio=1, overflow="fold")
        for names, help_text in rows:
            table.add_row(names, help_text)
    else:
        from rich.padding import Padding

        table.add_column(overflow="fold")
        for names, help_text in rows:
            table.add_row(names)
            if help_text.plain:
                table.add_row(Padding(help_text, (0, 0, 0, 6)))
    console.print(Panel(table, border_style=rich_utils.STYLE_OPTIONS_PANEL_BORDER, title=name,
                        title_align=rich_utils.ALIGN_OPTIONS_PANEL))


def _names(param: Any, ctx: Any, rich_utils: Any) -> Text:
    """`* -c, --config FILE` or `--flag / --no-flag`: the short names, the long ones, the metavar."""
    from typer.core import TyperArgument

    if isinstance(param, TyperArgument):
        label = param.display_name_raw + ("..." if param.metavar is None and param.nargs != 1 else "")
        names = Text(label)
    else:
        ordered = sorted(param.opts, key=lambda o: o.startswith("--"))
        text = ", ".join(ordered)
        if param.secondary_opts:
            text += " / " + ", ".join(sorted(param.secondary_opts, key=lambda o: o.startswith("--")))
        names = rich_utils.highlighter(Text(text))
    kind = param.display_type_rich(ctx=ctx)
    if kind and not isinstance(param, TyperArgument):
        names.append(" " + kind, style=rich_utils.STYLE_TYPES)
    if param.required:
        names = Text.assemble((rich_utils.REQUIRED_SHORT_STRING + " ", rich_utils.STYLE_REQUIRED_SHORT), names)
    return names
