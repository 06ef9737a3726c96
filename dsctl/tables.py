"""Tables that fit the terminal: pick the widest layout that needs no cut word.

A command builds its table in a few layouts, widest first (every column, then with
low-value columns dropped or merged into one wrapping column) and calls
`print_fitting`. A layout fits when each `no_wrap` column gets its widest cell and
every other column its longest word: rich then only has to wrap text, never cut it
("…") or fold a number. Keep at most one wrapping column per layout, since rich
shrinks the widest wrapping column first and could squeeze a second one below its
longest word. Headers of `no_wrap` columns break where they contain "\\n".
"""

from __future__ import annotations

from typing import Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


def needed_width(console: Console, table: Table) -> int:
    """Columns' fixed widths (no_wrap: widest cell; else longest word) + padding + borders."""
    options = console.options
    pad_left, pad_right = table.padding[3], table.padding[1]
    n = len(table.columns)
    total = 0
    for i, column in enumerate(table.columns):
        cells = ([column.header] if table.show_header else []) + list(column.cells)
        sizes = [Measurement.get(console, options, cell) for cell in cells] or [Measurement(1, 1)]
        width = max(m.maximum if column.no_wrap else m.minimum for m in sizes)
        if column.min_width is not None:
            width = max(width, column.min_width)
        left = pad_left if table.pad_edge or i > 0 else 0
        right = pad_right if table.pad_edge or i < n - 1 else 0
        total += width + left + right
    if table.box:
        total += len(table.columns) - 1 + (2 if table.show_edge else 0)
    return total


def pick_fitting(console: Console, layouts: Sequence[Table]) -> Table:
    """The first layout that fits the console's width (the last one when none does)."""
    for table in layouts:
        if needed_width(console, table) <= console.width:
            return table
    return layouts[-1]


def print_fitting(console: Console, layouts: Sequence[Table]) -> Table:
    table = pick_fitting(console, layouts)
    console.print(table)
    return table
