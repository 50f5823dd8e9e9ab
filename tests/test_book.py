"""The book built for real: every chapter executed, no warnings, failures fail, nothing stale."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from nnxscale.runtime.launch import Run

from book import CHAPTERS, ROOT, colab, copy_checkout
from conftest import jupyter_book

pytestmark = pytest.mark.book

NOISE = re.compile(r"DeprecationWarning|FutureWarning|UserWarning|RuntimeWarning|Traceback \(most")


def test_every_chapter_executed_successfully(built_book: Path) -> None:
    status = (built_book / "book" / "status.html").read_text()
    status = status[status.index("<table") :]
    for chapter in CHAPTERS:
        row = re.search(rf"{chapter.stem}\.html.*?</tr>", status, re.S)
        assert row, f"{chapter.stem} missing from the status page"
        cells = re.findall(r"<td><p>(.*?)</p></td>", row.group(0))
        assert cells[-3:-2] == ["cache"] and cells[-1] == "✅", cells


def test_status_page_names_versions_and_devices(built_book: Path) -> None:
    import jax

    status = (built_book / "book" / "status.html").read_text()
    assert f'<span class="pre">{jax.__version__}</span>' in status
    assert re.search(r"<p>devices</p></td>\s*<td><p><code[^>]*><span class=\"pre\">\d+<", status)


def test_no_warning_or_traceback_in_any_page(built_book: Path) -> None:
    pages = sorted(built_book.rglob("*.html"))
    noisy = [p.relative_to(built_book) for p in pages if NOISE.search(p.read_text())]
    assert not noisy, f"warnings or tracebacks shown on {noisy}"
    stderr = [p for p in pages if "output stderr" in p.read_text()]
    assert not stderr, f"cells wrote to stderr on {stderr}"


def test_sphinx_reported_no_warnings(built_book: Path) -> None:
    log = (ROOT / "_build" / "build.log").read_text()
    warnings = [line for line in log.splitlines() if "WARNING:" in line]
    assert not warnings, warnings


def test_every_chapter_page_and_its_executed_notebook_download_exist(built_book: Path) -> None:
    """The download button's notebook carries the build's outputs, though myst-nb read the
    chapter from jupyter-cache (where it writes a cached chapter without them)."""
    for chapter in CHAPTERS:
        page = (built_book / "chapters" / f"{chapter.stem}.html").read_text()
        download = built_book / "_sources" / "chapters" / f"{chapter.stem}.ipynb"
        cells = json.loads(download.read_text())["cells"]
        with_outputs = [c for c in cells if c["cell_type"] == "code" and c.get("outputs")]
        # every output the page shows is in the notebook (hidden cells add some of their own)
        assert len(with_outputs) >= page.count('class="cell_output'), chapter.stem
        assert with_outputs, chapter.stem


def test_each_page_loads_each_script_once_and_mathjax_from_the_book(built_book: Path) -> None:
    for page in sorted(built_book.rglob("*.html")):
        html = page.read_text().split("</head>")[0]  # the scripts a page registers
        inline = re.findall(r"<script>(.*?)</script>", html, re.S)
        sources = re.findall(r'<script[^>]* src="([^"]+)"', html)
        assert len(inline) == len(set(inline)), f"an inline script twice on {page.name}"
        assert len(sources) == len(set(sources)), f"a script loaded twice on {page.name}"
        if "tex-mml-chtml.js" in html:
            assert not [u for u in sources if "tex-mml-chtml" in u and "//" in u], page.name
    mathjax = built_book / "_static" / "mathjax" / "tex-mml-chtml.js"
    assert mathjax.stat().st_size > 100_000


def test_citations_and_bibliography_share_one_style(built_book: Path) -> None:
    """Cited as "Huang et al., 2019" in the text, listed under the same label."""
    bibliography = (built_book / "book" / "references.html").read_text()
    labels = re.findall(
        r'<span class="label"><span class="fn-bracket">\[</span>(.*?)<', bibliography
    )
    assert labels and all(re.fullmatch(r"[^\d\[\]{}]+, \d{4}[a-z]?", label) for label in labels)
    chapter = (built_book / "chapters" / f"{CHAPTERS[6].stem}.html").read_text()
    cited = re.findall(r'href="[^"]*references.html#[^"]*"[^>]*>(?:<span>)?([^<]*)<', chapter)
    assert cited and set(cited) <= set(labels), (cited, labels)
    assert {"Huang et al., 2019", "Narayanan et al., 2021b"} <= set(cited)


def test_colab_notebooks_hold_the_numbers_of_this_build(built_book: Path) -> None:
    """The values colab/*.ipynb write into the prose are this build's, but for those measured
    on the machine that built them (book/colab.py's MEASURED), which may differ."""
    stale = []
    for chapter in CHAPTERS:
        written = colab.written_values(
            ROOT / "chapters" / f"{chapter.stem}.ipynb", ROOT / "colab" / f"{chapter.stem}.ipynb"
        )
        assert written is not None, f"colab/{chapter.stem}.ipynb is not the chapter's source"
        fresh = colab.as_built(colab.glued(built_book.parent, chapter.stem))
        for key, text in written:
            name, _, spec = key.partition(":")
            if fresh(name, spec) != text and name not in colab.MEASURED:
                stale.append((chapter.stem, name, text, fresh(name, spec)))
    assert stale == [], f"{stale}: regenerate them with python book/colab.py"


def test_reader_text_keeps_straight_quotes(built_book: Path) -> None:
    """Table cells such as P('data', None) are code: no typographic quotes in any chapter."""
    for chapter in CHAPTERS:
        html = (built_book / "chapters" / f"{chapter.stem}.html").read_text()
        assert not re.search("[\u2018\u2019\u201c\u201d]", html), chapter.stem


def copy_of_the_book(destination: Path) -> Path:
    """This checkout's book, with only the first chapter (to stay quick), in a scratch folder."""
    copy_checkout(destination)
    toc = yaml.safe_load((destination / "_toc.yml").read_text())
    first = f"chapters/{CHAPTERS[0].stem}"
    for part in toc["parts"]:
        keep = [c for c in part["chapters"] if c["file"] == first or "chapters/" not in c["file"]]
        part["chapters"] = keep
    toc["parts"] = [part for part in toc["parts"] if part["chapters"]]  # none may be empty
    (destination / "_toc.yml").write_text(yaml.safe_dump(toc, sort_keys=False))
    assert first in (destination / "_toc.yml").read_text()
    return destination


def executed(result: Run) -> bool:
    return "chapter(s) with jupyter-cache, one per core" in result.text


def test_rebuilds_execute_again_when_needed_and_failures_fail(tmp_path: Path) -> None:
    book = copy_of_the_book(tmp_path / "book")
    first = jupyter_book("build", ".", cwd=book)
    assert first.returncodes == [0] and executed(first), first.text[-3000:]

    unchanged = jupyter_book("build", ".", cwd=book)
    assert unchanged.returncodes == [0] and not executed(unchanged)

    # `jupyter-book clean` keeps the cache of outputs: the pages are written again from it.
    assert jupyter_book("clean", ".", cwd=book).returncodes == [0]
    cleaned = jupyter_book("build", ".", cwd=book)
    assert cleaned.returncodes == [0] and not executed(cleaned), cleaned.text[-3000:]

    # Prose alone: the page is rebuilt from the cached outputs, nothing executes.
    chapter = book / "chapters" / f"{CHAPTERS[0].stem}.md"
    chapter.write_text(chapter.read_text() + "\nA sentence added to the prose.\n")
    prose = jupyter_book("build", ".", cwd=book)
    assert prose.returncodes == [0] and not executed(prose), prose.text[-3000:]
    html = (book / "_build" / "html" / "chapters" / f"{CHAPTERS[0].stem}.html").read_text()
    assert "A sentence added to the prose." in html

    # A change to the library alone re-executes the chapters.
    module = book / "src" / "nnxscale" / "analysis" / "comm.py"
    module.write_text(module.read_text() + "\n# touched\n")
    library = jupyter_book("build", ".", cwd=book)
    assert library.returncodes == [0] and executed(library)

    # A failing cell fails the build, names the error, and keeps failing on the next build.
    chapter.write_text(
        chapter.read_text() + '\n```{code-cell} ipython3\nraise RuntimeError("boom")\n```\n'
    )
    for _ in range(2):
        failed = jupyter_book("build", ".", cwd=book)
        assert failed.returncodes != [0]
        assert "boom" in failed.text
