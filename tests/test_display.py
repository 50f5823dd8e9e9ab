"""Markdown tables and source blocks for the chapters."""

from __future__ import annotations

from nnxscale.display import Markdown, source, table
from nnxscale.mesh import grid_shape


def test_table_aligns_numbers_and_escapes_pipes() -> None:
    text = table(["name", "bytes", "ratio"], [["a|b", 1234567, 0.125], ["c", 5.0, 2.0]], "T")
    assert text.splitlines() == [
        "T",
        "",
        "| name | bytes | ratio |",
        "|---|--:|--:|",
        "| a\\|b | 1,234,567 | 0.125 |",
        "| c | 5 | 2 |",
    ]
    assert text._repr_markdown_() == str(text)
    assert "| 819,399 |" in table(["sent"], [[819399.0]])


def test_source_is_the_real_source() -> None:
    block = source(grid_shape)
    assert isinstance(block, Markdown)
    assert block.startswith("```python\ndef grid_shape(")
    assert block.endswith("```")
