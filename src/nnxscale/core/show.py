"""What notebooks render: Markdown tables, the library's own source, values for the prose."""

from __future__ import annotations

import inspect
import math
import os
import textwrap
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

BOOK_BUILD_ENV = "NNXSCALE_BOOK_BUILD"
"""Set (to 1) by the book's Sphinx extension, so kernels it starts know they feed the book."""


class Markdown(str):
    """Text that Jupyter and the book render as Markdown."""

    def _repr_markdown_(self) -> str:
        return str(self)


def _column_format(values: list[object], spec: str | None) -> Callable[[object], str]:
    """One format for a whole column of numbers, so they line up: `spec` if given (a format
    such as `{:.1%}`); else exact integers with thousands separators, and floats in
    scientific notation (tiny differences) or with one number of decimals chosen by the
    column's largest value."""
    floats = [abs(v) for v in values if isinstance(v, float)]
    if spec is not None:
        float_format = spec
    elif not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        float_format = "{:,.4g}"  # a column of mixed values: each number as it is
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
        if isinstance(value, int) and spec is None:
            return f"{value:,}"
        return float_format.format(value)

    return cell


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[object]],
    title: str = "",
    *,
    formats: Mapping[str, str] | None = None,
) -> Markdown:
    """A Markdown table; numbers are right-aligned and formatted alike down each column. A
    column whose header `formats` names takes that format (`{"bubble": "{:.1%}"}`); the
    others write integers exactly and floats as `_column_format` chooses."""
    rows = [list(row) for row in rows]
    formats = dict(formats or {})
    unknown = sorted(set(formats) - set(headers))
    if unknown:
        raise ValueError(f"formats for columns the table does not have: {unknown}")
    numeric = [all(isinstance(r[i], int | float) for r in rows) for i in range(len(headers))]
    cells = [_column_format([r[i] for r in rows], formats.get(h)) for i, h in enumerate(headers)]
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
    """Record `value` for the book's prose (`{glue:text}`name``) with myst-nb's own `glue`,
    in a book build only: in Jupyter or Colab, where myst-nb may not be installed, the call
    does nothing and shows nothing, so a chapter needs nothing but `nnxscale`."""
    if os.environ.get(BOOK_BUILD_ENV) != "1":
        return
    from myst_nb import glue as record

    record(name, value, display=False)


def raised[E: BaseException](call: Callable[[], object], kind: type[E] | str, width: int = 96) -> E:
    """Call `call`, which must raise `kind` (a class, or a class's name for errors a library
    does not export, such as JAX's ShardingTypeError): print the error as a reader sees it
    (its type and message, wrapped to `width`) and return it. Raise AssertionError if it
    raises nothing; an error of another kind goes through unchanged."""
    catch = kind if isinstance(kind, type) else Exception
    try:
        call()
    except catch as error:
        if not isinstance(kind, type) and kind not in {c.__name__ for c in type(error).__mro__}:
            raise
        print(textwrap.fill(f"{type(error).__name__}: {error}", width))
        return error
    name = kind if isinstance(kind, str) else kind.__name__
    raise AssertionError(f"expected {name}, and nothing was raised")


def warned[W: Warning](call: Callable[[], Any], kind: type[W], width: int = 96) -> tuple[Any, W]:
    """Call `call`, which must warn `kind`: print the first such warning as a reader sees it
    and return what `call` returned, with it. Raise AssertionError if it does not warn."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = call()
    found = [w.message for w in seen if isinstance(w.message, kind)]
    if not found:
        raise AssertionError(f"expected a {kind.__name__}, and none was given")
    print(textwrap.fill(f"{kind.__name__}: {found[0]}", width))
    return result, found[0]
