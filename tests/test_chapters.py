"""Every chapter: a MyST source and its committed, output-free notebook twin, set up alike."""

from __future__ import annotations

import ast
import json
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import jupytext
import pytest
import yaml

from book import CHAPTERS, KERNEL_PACKAGES, ROOT, setup_cell, tracked

NAMES = [c.stem for c in CHAPTERS]
README = (ROOT / "README.md").read_text()


def test_the_readme_lists_every_chapter_in_order_with_its_title() -> None:
    listed = re.findall(r"^\| (\w+) \| \[([^\]]+)\]\(chapters/(\w+)\.md\)", README, re.M)
    assert [name for _, _, name in listed] == NAMES
    for _, title, name in listed:  # the link says what the chapter's own heading says
        heading = re.search(r"^# (.+)$", (ROOT / "chapters" / f"{name}.md").read_text(), re.M)
        assert heading and heading[1].removeprefix("Appendix: ").lower() == title.lower(), name


def test_the_table_of_contents_lists_every_chapter_in_order() -> None:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    listed = [
        entry["file"]
        for part in toc["parts"]
        for entry in part["chapters"]
        if entry["file"].startswith("chapters/")
    ]
    assert listed == [f"chapters/{name}" for name in NAMES]


@pytest.mark.parametrize("md", CHAPTERS, ids=NAMES)
def test_notebook_twin_is_committed_with_the_same_cells_and_no_outputs(md: Path) -> None:
    nb_path = md.with_suffix(".ipynb")
    assert nb_path.exists(), f"run: jupytext --sync {md.relative_to(ROOT)}"
    assert tracked(nb_path), f"{nb_path.name} is not committed; Colab opens the committed file"
    source = [(c.cell_type, c.source.strip()) for c in jupytext.read(md).cells]
    raw = json.loads(nb_path.read_text())
    twin = [(c["cell_type"], "".join(c["source"]).strip()) for c in raw["cells"]]
    assert twin == source, f"cells differ: run jupytext --sync {md.relative_to(ROOT)}"
    code = [c for c in raw["cells"] if c["cell_type"] == "code"]
    assert not any(c["outputs"] or c["execution_count"] for c in code), "strip the outputs"
    assert raw["metadata"]["kernelspec"]["name"] == "python3"
    assert raw["metadata"]["jupytext"]["formats"] == "ipynb,md:myst"


@pytest.mark.parametrize("md", CHAPTERS, ids=NAMES)
def test_first_code_cell_is_the_hidden_setup_cell(md: Path) -> None:
    code = [c for c in jupytext.read(md).cells if c.cell_type == "code"]
    assert code[0].source.strip() == setup_cell()
    assert code[0].metadata.get("tags") == ["hide-cell"]


@pytest.mark.parametrize("md", CHAPTERS, ids=NAMES)
def test_every_cell_holds_something(md: Path) -> None:
    empty = [i for i, c in enumerate(jupytext.read(md).cells) if not c.source.strip()]
    assert not empty, f"cells {empty} are empty: delete them"


def distribution(requirement: str) -> str:
    """The normalised distribution name of a requirement such as `orbax-checkpoint>=0.11`."""
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def installable_distributions() -> set[str]:
    """What a reader's kernel has: nnxscale's declared dependencies, the kernel and its own."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {distribution(r) for r in project["dependencies"]}
    kernel = {distribution(r) for name in KERNEL_PACKAGES
              for r in metadata.requires(name) or [] if "extra ==" not in r}  # fmt: skip
    return declared | kernel | set(KERNEL_PACKAGES) | {"nnxscale"}


@pytest.mark.slow
@pytest.mark.parametrize("md", CHAPTERS, ids=NAMES)
def test_every_import_is_a_declared_dependency(md: Path) -> None:
    providers = metadata.packages_distributions()
    allowed = installable_distributions()
    undeclared = {}
    for cell in jupytext.read(md).cells:
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for top in {name.split(".")[0] for name in names}:
                if top in sys.stdlib_module_names:
                    continue
                dists = {distribution(d) for d in providers.get(top, [top])}
                if not dists & allowed:
                    undeclared[top] = sorted(dists)
    assert not undeclared, f"imports that `pip install nnxscale` does not bring: {undeclared}"


@pytest.mark.parametrize("md", CHAPTERS, ids=NAMES)
def test_reader_code_carries_no_build_plumbing(md: Path) -> None:
    """What the book shows is what a reader would write: no formatter or linter pragmas, and
    the values glued into the prose recorded in cells the book removes."""
    for cell in jupytext.read(md).cells:
        if cell.cell_type != "code":
            continue
        assert "fmt: skip" not in cell.source and "noqa" not in cell.source, cell.source
        if "nx.show.glue(" in cell.source:
            assert "remove-cell" in cell.metadata.get("tags", []), cell.source
            calls = [
                node
                for node in ast.parse(cell.source).body
                if not (isinstance(node, ast.Expr) and "nx.show.glue" in ast.unparse(node))
            ]
            assert calls == [], "a glue cell holds glue calls only"


@pytest.mark.parametrize("md", CHAPTERS, ids=NAMES)
def test_figures_are_named_captioned_and_described(md: Path) -> None:
    """Every cell that draws has a figure name, a caption and alt text; names are unique."""
    names = []
    for cell in jupytext.read(md).cells:
        if cell.cell_type != "code" or not re.search(r"figures\.plot_|plt\.subplots", cell.source):
            continue
        options = cell.metadata.get("mystnb", {})
        figure, image = options.get("figure", {}), options.get("image", {})
        assert figure.get("name", "").startswith("fig-"), cell.source[:80]
        assert len(figure.get("caption", "")) > 30 and len(image.get("alt", "")) > 30
        names.append(figure["name"])
    assert names, "each chapter explains its mechanism with at least one figure"
    assert len(names) == len(set(names))


NUMBERED = {int(c.name[:2]): c.name for c in CHAPTERS if c.name[:2].isdigit()}
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def prose_of(text: str) -> str:
    """`text` with its code cells and front matter blanked (same length, so spans agree)."""
    blank = lambda m: re.sub(r"[^\n]", " ", m[0])  # noqa: E731
    text = re.sub(r"\A---\n.*?\n---\n", blank, text, flags=re.S)
    return re.sub(r"```\{code-cell\}.*?```", blank, text, flags=re.S)


def anchors(md: Path) -> set[str]:
    """The anchors of `md`'s headings as MyST makes them (`myst_heading_anchors`)."""
    headings = re.findall(r"^#{1,3} (.+)$", prose_of(md.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("md", CHAPTERS, ids=NAMES)
def test_every_chapter_reference_is_a_link_to_the_chapter_that_holds_it(md: Path) -> None:
    """A chapter cited by number is a link to the file of that number (and to a heading that
    file has): renumbering the chapters cannot leave a stale "chapter 11" behind."""
    text = prose_of(md.read_text())
    links = list(LINK.finditer(text))
    bare = [m[0] for m in re.finditer(r"\b[Cc]hapters? \d+", text)
            if not any(link.start() <= m.start() < link.end() for link in links)]  # fmt: skip
    assert not bare, f"chapters cited without a link: {bare}"
    for link in links:
        cited = re.match(r"(?:[Cc]hapters? )?(\d+)\b", link[1])
        if cited is None or ".md" not in link[2]:
            continue
        file, _, anchor = link[2].partition("#")
        assert file == NUMBERED.get(int(cited[1])), f"{link[0]} leads to {file}"
        assert not anchor or anchor in anchors(md.parent / file), f"{link[0]}: no such heading"
