"""Markdown, CSV and console tables: the package's one renderer (results.md, `memfit aggregate`, the paper's
tables, the console tables of plan, compare, profile and data stats). A leaf: it imports nothing of memfit_gpu.

Callers format their cells (x100, decimals, "-" for a missing value) and choose each column's
alignment; tabulate lays out the Markdown (its number parsing off, so "50.00" stays "50.00"), the
standard csv module writes the CSV.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any, Literal

from tabulate import tabulate

Align = Literal["left", "right"]


def _escape(text: str) -> str:
    return text.replace("|", "\\|")  # a bare pipe would end the cell


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                   align: Sequence[Align] | None = None) -> str:
    """A GitHub Markdown (pipe) table.

    Args:
        header: column names.
        rows: formatted cells, one sequence per row, as long as `header`.
        align: per column; default every column left (numbers read best right-aligned).

    Returns:
        The table, padded to column width, ending in a newline. `|` inside a cell is escaped.
    """
    align = list(align) if align is not None else ["left"] * len(header)
    if len(align) != len(header) or any(len(row) != len(header) for row in rows):
        raise ValueError(f"table of {len(header)} columns: every row and the alignment need as many cells")
    body = [[_escape(str(cell)) for cell in row] for row in rows]
    text = tabulate(body, headers=[_escape(h) for h in header], tablefmt="pipe", disable_numparse=True,
                    colalign=align)
    return text + "\n"


def console_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                  align: Sequence[Align] | None = None) -> str:
    """A plain-text table for the terminal: the header, a rule of dashes, the rows, columns padded to width
    and two spaces apart (tabulate's "simple" layout). Same arguments as `markdown_table`; no trailing
    newline, so callers join it with their own lines."""
    align = list(align) if align is not None else ["left"] * len(header)
    if len(align) != len(header) or any(len(row) != len(header) for row in rows):
        raise ValueError(f"table of {len(header)} columns: every row and the alignment need as many cells")
    return tabulate([[str(cell) for cell in row] for row in rows], headers=list(header), tablefmt="simple",
                    disable_numparse=True, colalign=align)


def csv_text(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """CSV with a header line; cells written as given (None as an empty cell), lines end in \\n."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(["" if cell is None else cell for cell in row] for row in rows)
    return buffer.getvalue()

