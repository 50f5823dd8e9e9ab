"""What the Colab links open, `colab/NN_slug.ipynb`: each chapter in plain Markdown, with
the build's numbers written in, links to the published book, and folded cells collapsed.

`book/colab.py` writes these notebooks from an executed build. The fast tests here need no
build: they check that each notebook is its chapter as the source now reads, apart from the
glued values, and that no MyST reaches Colab. `test_book.py` checks the values against a
fresh build."""

from __future__ import annotations

import json
import re

import nbformat
import pytest

from book import CHAPTERS, ROOT, colab

NOTEBOOKS = [ROOT / "colab" / f"{chapter.stem}.ipynb" for chapter in CHAPTERS]
REGENERATE = "regenerate them: jupyter-book build . && python book/colab.py"


def test_there_is_one_colab_notebook_per_chapter_and_no_other() -> None:
    assert sorted((ROOT / "colab").glob("*.ipynb")) == sorted(NOTEBOOKS), REGENERATE


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.stem for n in NOTEBOOKS])
def test_the_colab_notebook_is_the_chapter_as_its_source_reads(notebook) -> None:
    chapter = ROOT / "chapters" / notebook.name
    values = colab.written_values(chapter, notebook)
    assert values is not None, f"{notebook.name} is not chapters/{notebook.name}: {REGENERATE}"
    assert all(text.strip() for _, text in values), values


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.stem for n in NOTEBOOKS])
def test_no_myst_reaches_colab_and_links_lead_to_the_book(notebook) -> None:
    cells = nbformat.read(notebook, as_version=4).cells
    prose = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    assert colab.ROLE.findall(prose) == []
    assert colab.DIRECTIVE.findall(prose) == []
    targets = [t.strip("<>") for t in colab.LINK.findall(prose)]
    assert targets, "every chapter links to the glossary or another chapter"
    assert [t for t in targets if not t.startswith(("https://", "http://"))] == []
    book = [t for t in targets if t.startswith(colab.site())]
    assert book and all(re.search(r"\.html(#[\w-]+)?$", t) for t in book), book


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.stem for n in NOTEBOOKS])
def test_cells_the_book_folds_start_collapsed_and_none_carries_an_output(notebook) -> None:
    raw = json.loads(notebook.read_text())
    code = [c for c in raw["cells"] if c["cell_type"] == "code"]
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    for cell in code:
        folded = bool(colab.FOLDED & set(cell["metadata"].get("tags", [])))
        titled = "".join(cell["source"]).startswith("# @title ")
        assert folded == titled == (cell["metadata"].get("cellView") == "form"), cell["source"]
    answers = [c for c in code if "".join(c["source"]).startswith("# @title Answer to")]
    assert len(answers) >= 4 or notebook.stem >= "A", notebook.name
    assert "jupytext" not in raw["metadata"], "a Colab notebook is not paired with the source"


def test_a_chapter_that_changed_after_its_colab_notebook_is_caught(tmp_path) -> None:
    chapter, notebook = ROOT / "chapters" / NOTEBOOKS[0].name, NOTEBOOKS[0]
    changed = nbformat.read(chapter, as_version=4)
    prose = next(c for c in changed.cells if c.cell_type == "markdown" and "{glue" in c.source)
    prose.source = prose.source.replace(" ", "  ", 1)
    nbformat.write(changed, tmp_path / chapter.name)
    assert colab.written_values(tmp_path / chapter.name, notebook) is None
    assert colab.written_values(chapter, notebook) is not None
