"""Fitting a Rich table of string cells into a terminal: drop the least-read columns first rather than folding every
cell (the bench summary and the eval summary share it)."""
from __future__ import annotations


def natural_width(cells: list[dict], cols) -> int:
    """Characters the table needs unwrapped: each column as wide as its header or widest cell, plus Rich's border
    and padding (3 per column) and the closing border."""
    return sum(max(len(c), *(len(r[c]) for r in cells)) + 3 for c in cols) + 1


def drop_to_fit(cells: list[dict], cols: list[str], order, width: int | None) -> list[str]:
    """`cols` without the columns of `order` (in that order) that must go for the table to fit `width`."""
    cols = list(cols)
    for c in order:
        if width is None or not cells or natural_width(cells, cols) <= width:
            break
        if c in cols:
            cols.remove(c)
    return cols
