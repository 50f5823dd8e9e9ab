"""What notebooks render: Markdown tables and the library's own source as code blocks."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence


class Markdown(str):
    """Text that Jupyter and the book render as Markdown."""

    def _repr_markdown_(self) -> str:
        return str(self)


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], title: str = "") -> Markdown:
    """A Markdown table; numbers are right-aligned and integers get thousands separators."""
    rows = [list(row) for row in rows]
    numeric = [all(isinstance(r[i], int | float) for r in rows) for i in range(len(headers))]

    def cell(value: object) -> str:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return str(value).replace("|", "\\|")
        if isinstance(value, int) or abs(value) >= 1000:  # counts and byte totals: exact digits
            return f"{value:,.0f}"
        return f"{value:,.4g}"

    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("--:" if n else "---" for n in numeric) + "|",
        *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows),
    ]
    return Markdown((f"{title}\n\n" if title else "") + "\n".join(lines))


def source(obj: object) -> Markdown:
    """The real source of a function or class, as a Python code block."""
    return Markdown(f"```python\n{inspect.getsource(obj).rstrip()}\n```")
