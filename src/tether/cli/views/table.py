"""Tables that fit the terminal (issue 32): columns dropped by priority, never a key column cut.

A list command names its columns with a priority: key columns (a name, an id, a status: what a person
reads or copies) are always shown whole; the others are dropped, least important first, until the rest
fit the console's width. One column may be `flex`: it is folded onto more lines instead of widening
the table (a request's words, capabilities). `wide` (`-o wide`) keeps every column and prints the table
as wide as it needs. When columns were dropped, the caption says which and how to see them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from tether.cli.views.safe_text import SafeConsole

if TYPE_CHECKING:
    from rich.console import Console

_WIDE = 10_000  # a console this wide never squeezes a table: -o wide prints it at its natural width
KEY = 0  # the priority of a key column: never dropped, never cut


@dataclass(frozen=True)
class Column:
    """One column: `name` (its header), `priority` (KEY, or 1 and up: higher is dropped first),
    `flex` (folded onto more lines rather than dropped while `min_width` characters fit)."""

    name: str
    priority: int = KEY
    flex: bool = False
    min_width: int = 12


def _width(cell: str | Text) -> int:
    text = cell if isinstance(cell, Text) else Text.from_markup(cell)
    return max((Text(line).cell_len for line in text.plain.splitlines()), default=0)


def _overhead(count: int) -> int:
    """Borders and padding of a rich table with `count` columns (the default box, padding 1 each side)."""
    return 3 * count + 1


def fit(columns: Sequence[Column], rows: Sequence[Sequence[str | Text]], width: int,
        wide: bool = False) -> list[int]:
    """The indices of the columns to show so that the table fits `width` (all of them when `wide`).

    Each column needs its longest cell (a flex column: `min_width`, or less when its cells are shorter);
    columns are dropped by priority (highest number first, later ones first among equals) until the
    rest fit. Key columns are never dropped, even when they alone are wider than `width`."""
    needs = [max([len(c.name), *(_width(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    needs = [min(n, max(c.min_width, len(c.name))) if c.flex else n for n, c in zip(needs, columns, strict=True)]
    shown = list(range(len(columns)))
    if wide:
        return shown
    droppable = sorted((i for i, c in enumerate(columns) if c.priority != KEY),
                       key=lambda i: (columns[i].priority, i), reverse=True)
    while sum(needs[i] for i in shown) + _overhead(len(shown)) > width and droppable:
        shown.remove(droppable.pop(0))
    return shown


def fitted_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str | Text]], out: Console,
                 wide: bool = False) -> Table:
    """A rich table of `rows` (cells as rich markup or Text, one per column) for `out`'s width: the
    columns that `fit` keeps, key and other non-flex columns never wrapped or cut, flex ones folded."""
    shown = fit(columns, rows, out.width, wide)
    dropped = [c.name for i, c in enumerate(columns) if i not in shown]
    caption = f"not shown: {', '.join(dropped)} (-o wide: every column)" if dropped else None
    table = Table(title=title, caption=caption)
    for i in shown:
        column = columns[i]
        longest = max([len(column.name), *(_width(r[i]) for r in rows)])
        if column.flex:
            table.add_column(column.name, overflow="fold", min_width=min(longest, column.min_width))
        else:
            table.add_column(column.name, no_wrap=True, min_width=longest)
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    return table


def print_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str | Text]],
                wide: bool = False) -> None:
    """Print `fitted_table` on stdout (through `SafeConsole`: terminal controls in cells shown as
    escapes) at the terminal's width; with `wide`, as wide as the table needs (a pipe or a pager scrolls)."""
    out = SafeConsole(highlight=False, width=_WIDE if wide else None)
    out.print(fitted_table(title, columns, rows, out, wide))
