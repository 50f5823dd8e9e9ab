"""What notebooks render: Markdown tables, the library's own source, values for the prose."""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Iterable, Sequence

BOOK_BUILD_ENV = "NNXSCALE_BOOK_BUILD"
"""Set (to 1) by the book's Sphinx extension, so kernels it starts know they feed the book."""

GLUE_PREFIX = "application/papermill.record/"
"""The MIME prefix myst-nb reads glued values from (and that no notebook front end renders)."""


class Markdown(str):
    """Text that Jupyter and the book render as Markdown."""

    def _repr_markdown_(self) -> str:
        return str(self)


PERCENT_WORDS = ("share", "relative", "bubble", "idle", "fraction")
"""A float column whose header contains one of these prints as percentages."""


def _column_format(header: str, values: list[object]) -> Callable[[object], str]:
    """One format for a whole column of numbers, so they line up: exact integers with
    thousands separators; floats as percentages (shares), in scientific notation (tiny
    differences) or with one number of decimals chosen by the column's largest value."""
    floats = [abs(v) for v in values if isinstance(v, float)]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        float_format = "{:,.4g}"  # a column of mixed values: each number as it is
    elif any(word in header.lower() for word in PERCENT_WORDS) and floats and max(floats) <= 10:
        float_format = "{:.1%}"
    elif all(v == int(v) or v >= 1000 for v in floats):
        float_format = "{:,.0f}"
    elif any(0 < v < 1e-3 for v in floats):
        float_format = "{:.1e}"
    else:
        digits = math.floor(math.log10(max(floats))) + 1 if max(floats) > 0 else 1
        float_format = f"{{:,.{min(4, max(1, 4 - digits))}f}}"

    def cell(value: object) -> str:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return str(value).replace("|", "\\|")
        return f"{value:,}" if isinstance(value, int) else float_format.format(value)

    return cell


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], title: str = "") -> Markdown:
    """A Markdown table; numbers are right-aligned and formatted alike down each column."""
    rows = [list(row) for row in rows]
    numeric = [all(isinstance(r[i], int | float) for r in rows) for i in range(len(headers))]
    cells = [_column_format(h, [r[i] for r in rows]) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("--:" if n else "---" for n in numeric) + "|",
        *("| " + " | ".join(cells[i](v) for i, v in enumerate(row)) + " |" for row in rows),
    ]
    return Markdown((f"{title}\n\n" if title else "") + "\n".join(lines))


def source(obj: object) -> Markdown:
    """The real source of a function or class, as a Python code block."""
    return Markdown(f"```python\n{inspect.getsource(obj).rstrip()}\n```")


def glue(name: str, value: object) -> None:
    """Record `value` for the book's prose (`{glue:text}`name``); outside a book build, nothing.

    The record is the display output myst-nb's own `glue` writes, so the build tool is not
    needed to run a chapter: in Jupyter or Colab the call does nothing and shows nothing.
    """
    if os.environ.get(BOOK_BUILD_ENV) != "1":
        return
    from IPython.core.formatters import format_display_data
    from IPython.display import display

    bundle, metadata = format_display_data(value)
    metadata["scrapbook"] = {"name": name, "mime_prefix": GLUE_PREFIX}
    display({GLUE_PREFIX + k: v for k, v in bundle.items()}, raw=True, metadata=metadata)
