"""Markdown tables and source blocks for the chapters."""

from __future__ import annotations

import IPython.display
import pytest

from nnxscale.mesh import grid_shape
from nnxscale.show import BOOK_BUILD_ENV, GLUE_PREFIX, Markdown, glue, source, table


def test_table_aligns_numbers_and_escapes_pipes() -> None:
    text = table(["name", "bytes", "ratio"], [["a|b", 1234567, 0.125], ["c", 5.0, 2.0]], "T")
    assert text.splitlines() == [
        "T",
        "",
        "| name | bytes | ratio |",
        "|---|--:|--:|",
        "| a\\|b | 1,234,567 | 0.125 |",
        "| c | 5 | 2.000 |",
    ]
    assert text._repr_markdown_() == str(text)
    assert "| 819,399 |" in table(["sent"], [[819399.0]])


def test_numbers_among_text_keep_their_own_digits() -> None:
    assert table(["field", "value"], [["decay", 0.9], ["name", "FSDP"]]).splitlines()[2] == (
        "| decay | 0.9 |"
    )


def test_each_column_has_one_format() -> None:
    text = table(
        ["share of state", "gap", "ms", "relative"],
        [[0.9066, 1.2e-6, 12.5, 0.5], [0.007681, 3e-7, 150.25, 1.0]],
    )
    assert text.splitlines()[2:] == [
        "| 90.7% | 1.2e-06 | 12.5 | 50.0% |",
        "| 0.8% | 3.0e-07 | 150.2 | 100.0% |",
    ]


def test_source_is_the_real_source() -> None:
    block = source(grid_shape)
    assert isinstance(block, Markdown)
    assert block.startswith("```python\ndef grid_shape(")
    assert block.endswith("```")


def test_glue_records_for_the_book_build_only(monkeypatch: pytest.MonkeyPatch) -> None:
    shown: list[tuple[dict, dict]] = []
    monkeypatch.setattr(
        IPython.display, "display", lambda bundle, raw, metadata: shown.append((bundle, metadata))
    )
    monkeypatch.delenv(BOOK_BUILD_ENV, raising=False)
    glue("answer", 42)
    assert shown == []  # Jupyter, Colab: nothing shown, no build tool needed
    monkeypatch.setenv(BOOK_BUILD_ENV, "1")
    glue("answer", "1,234")
    [(bundle, metadata)] = shown
    assert bundle == {"application/papermill.record/text/plain": "'1,234'"}
    assert metadata["scrapbook"] == {"name": "answer", "mime_prefix": GLUE_PREFIX}
