"""Markdown tables and source blocks for the chapters."""

from __future__ import annotations

import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from nnxscale.core.show import BOOK_BUILD_ENV, Markdown, glue, source, table
from nnxscale.placement.mesh import grid_shape


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


def test_each_column_has_one_format_the_table_is_given_or_chooses() -> None:
    headers = ["share of state", "gap", "ms", "relative"]
    rows = [[0.9066, 1.2e-6, 12.5, 0.5], [0.007681, 3e-7, 150.25, 1]]
    text = table(headers, rows, formats={"share of state": "{:.1%}", "relative": "{:.0%}"})
    assert text.splitlines()[2:] == [
        "| 90.7% | 1.2e-06 | 12.5 | 50% |",
        "| 0.8% | 3.0e-07 | 150.2 | 100% |",
    ]
    # no format asked for: a header's words choose nothing
    assert table(headers, rows).splitlines()[2] == "| 0.9066 | 1.2e-06 | 12.5 | 0.5000 |"
    with pytest.raises(
        ValueError, match=r"formats for columns the table does not have: \['ratio'\]"
    ):
        table(headers, rows, formats={"ratio": "{:.1%}"})


def test_source_is_the_real_source() -> None:
    block = source(grid_shape)
    assert isinstance(block, Markdown)
    assert block.startswith("```python\ndef grid_shape(")
    assert block.endswith("```")


@pytest.fixture
def shell():
    """A kernel's shell, whose display outputs `capture_output` collects; gone afterwards."""
    yield InteractiveShell.instance()
    InteractiveShell.clear_instance()


def test_glue_records_with_myst_nb_in_a_book_build_only(shell, monkeypatch) -> None:
    monkeypatch.delenv(BOOK_BUILD_ENV, raising=False)
    with capture_output() as outside:
        glue("answer", 42)
    assert outside.outputs == [] and outside.stdout == ""  # Jupyter, Colab: nothing at all
    monkeypatch.setenv(BOOK_BUILD_ENV, "1")
    with capture_output() as built:
        glue("answer", "1,234")
    (record,) = built.outputs
    # myst-nb's own record: a hidden output that the build reads, whatever its format
    assert record.metadata["scrapbook"]["name"] == "answer"
    prefix = record.metadata["scrapbook"]["mime_prefix"]
    assert prefix and record.data == {f"{prefix}text/plain": "'1,234'"}
