"""Markdown tables and number formatting shared by every rafl report."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["binomial_se", "markdown_table", "fmt", "fmt_bytes"]

def binomial_se(p: float, n: int) -> float:
    """Binomial standard error ``sqrt(p (1 - p) / n)`` of an accuracy ``p`` measured on ``n`` test
    images (NaN for ``n`` = 0). It is 0 at ``p`` = 0 or 1, so a table shows the count ``n`` beside
    it: 1.000 on 4 images is 4 of 4, and one image moves it by 1/n = 0.25."""
    if n <= 0 or p is None or math.isnan(p):
        return float("nan")
    return math.sqrt(max(p * (1 - p), 0.0) / n)

_BYTE_UNITS = (("kB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12))


def fmt_bytes(n: float) -> str:
    """A byte count in the unit that shows it, decimal (1 kB = 1000 B, 1 MB = 1e6 B, as rafl's MB
    columns): ``"440 B"``, ``"8.8 kB"``, ``"1.23 MB"``; 3 significant digits. A small payload
    printed in MB read as zero (440 B was ``0.000 MB``)."""
    n = float(n)
    if math.isnan(n):
        return "n/a"
    if abs(n) < 999.5:
        return f"{n:.0f} B"
    for unit, scale in _BYTE_UNITS:
        text = f"{n / scale:.3g}"
        if abs(float(text)) < 1000 or unit == _BYTE_UNITS[-1][0]:
            return f"{text} {unit}"
    raise AssertionError("unreachable")


def fmt(value: Any, digits: int = 4) -> str:
    """Format a cell: ints with thousands separators, floats with ``digits`` significant digits,
    NaN as ``n/a``, booleans as ``pass`` / ``FAIL``, anything else with ``str``."""
    if isinstance(value, bool):
        return "pass" if value else "FAIL"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.{digits}g}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None,
                   digits: int = 4) -> str:
    """A GitHub-flavoured Markdown table.

    Args:
        headers: column titles.
        rows: cells (formatted with :func:`fmt`); each row must have ``len(headers)`` cells.
        align: one character per column, ``l``/``r``/``c`` (default: numbers right, text left,
            judged from the first row).
        digits: significant digits for floats.

    Returns:
        the table text, ending with a newline.

    Raises:
        ValueError: a row with the wrong number of cells.
    """
    if align is None:
        first = rows[0] if rows else [""] * len(headers)
        align = "".join("r" if isinstance(c, (int, float)) and not isinstance(c, bool) else "l" for c in first)
    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(str(h) for h in headers) + " |",
             "|" + "|".join(marks[a] for a in align) + "|"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, expected {len(headers)}")
        lines.append("| " + " | ".join(fmt(c, digits).replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines) + "\n"
