"""What notebooks render: Markdown tables, the library's own source, values for the prose."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Sequence

BOOK_BUILD_ENV = "NNXSCALE_BOOK_BUILD"
"""Set (to 1) by the book's Sphinx extension, so kernels it starts know they feed the book."""

GLUE_PREFIX = "application/papermill.record/"
"""The MIME prefix myst-nb reads glued values from (and that no notebook front end renders)."""


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
