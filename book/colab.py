"""Write the notebooks Colab opens, `colab/NN_slug.ipynb`, from the executed book.

Run after `jupyter-book build .`: python book/colab.py

Colab renders Markdown, not MyST. A chapter's own notebook (`chapters/NN_slug.ipynb`, the
jupytext pair of its source) would show `{glue:text}` and `{cite:p}` roles as raw text, and
its answers open. Each Colab notebook is the chapter's notebook with, in its Markdown, every
glued value written in as the build printed it, every citation as the book labels it and
every link to a chapter, a figure, a heading or a glossary term pointed at the published book;
and with each code cell the book folds or removes collapsed under a title (a Colab form, and
`source_hidden` for Jupyter). Its code cells are the chapter's, without outputs.
"""

from __future__ import annotations

import json
import posixpath
import re
import sys
from collections.abc import Callable
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "_build"
OUT = ROOT / "colab"
sys.path.insert(0, str(ROOT / "book" / "_ext"))

from nnxscale_book import citation_labels  # noqa: E402

MEASURED = {
    "other_seconds", "busy_share", "waiting_share", "collective_share", "mfu", "ridge_here",
    "above_roof", "compute_bound_sentence",
}  # fmt: skip
"""Glued values measured on the machine that runs the chapter (seconds, shares of a profile):
a Colab notebook holds those of the build that wrote it, and a later build may differ."""
ROLE = re.compile(r"\{([a-z][\w:-]*)\}`([^`]*)`")
"""A MyST role, `{name}`content``: none may reach Colab."""
DIRECTIVE = re.compile(r"^(```|:::)\{[a-z][\w-]*\}|^\([\w-]+\)=\s*$", re.MULTILINE)
"""A MyST directive fence or a `(label)=` target: none may reach Colab."""
LINK = re.compile(r"\]\((<[^>]*>|[^)\s]*)\)")
FOLDED = {"hide-cell", "hide-input", "remove-cell", "remove-input"}
"""Tags of the code cells the book does not show open; in Colab they start collapsed."""
Render = Callable[[str, str], str]
"""Writes a glued value from its name and format specification (`{glue:text}`name:.1f``)."""
UNTITLED = "Values for the prose (a cell the book does not show)"


def site() -> str:
    """Where the book is published (`html.baseurl`), ending in a slash."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    return config["html"]["baseurl"].rstrip("/") + "/"


def glossary_terms() -> dict[str, str]:
    """Each glossary term in lower case, and its anchor on the glossary page."""
    text = (ROOT / "book" / "glossary.md").read_text()
    block = text.split("```{glossary}", 1)[1].split("```", 1)[0]
    terms = [line.strip() for line in block.splitlines() if line and not line[0].isspace()]
    return {term.lower(): "term-" + term.replace(" ", "-") for term in terms}


def glued(build: Path, chapter: str) -> dict[str, str]:
    """Each value chapter `chapter` glued in the executed `build`, as its `text/plain`."""
    executed = build / "jupyter_execute" / "chapters"
    if not (executed / f"{chapter}.ipynb").exists():
        raise SystemExit(f"no executed {chapter} in {build}: run jupyter-book build . first")
    records = executed / f"{chapter}.glue.json"  # myst-nb's, absent where nothing is glued
    if not records.exists():
        return {}
    return {name: r["data"]["text/plain"] for name, r in json.loads(records.read_text()).items()}


def substitute_roles(text: str, glue: Render, labels: dict[str, str]) -> str:
    """`text` with each glue role replaced by `glue(name, format)` and each citation by its
    label."""
    references = site() + "book/references.html"

    def replace(match: re.Match) -> str:
        role, content = match.groups()
        if role == "glue:text":
            name, _, spec = content.partition(":")
            return glue(name, spec)
        if role in ("cite:p", "cite:t"):
            cited = [labels[key.strip()] for key in content.split(",")]
            if role == "cite:t":  # Huang et al. (2019), as the book writes it
                return "; ".join(
                    f"{names} ([{year}]({references}))"
                    for names, _, year in (label.rpartition(", ") for label in cited)
                )
            return "(" + "; ".join(f"[{label}]({references})" for label in cited) + ")"
        return match.group(0)  # left for the check below to name

    return ROLE.sub(replace, text)


def absolute_links(text: str, page: str, terms: dict[str, str]) -> str:
    """`text` with links to book pages, figures, headings and terms made absolute."""
    base = site()

    def replace(match: re.Match) -> str:
        target = match.group(1).strip("<>")
        if target.startswith(("http://", "https://", "mailto:")):
            return match.group(0)
        path, _, anchor = target.partition("#")
        if not path and anchor.lower() in terms:
            return f"]({base}book/glossary.html#{terms[anchor.lower()]})"
        if path.endswith(".md"):
            url = base + posixpath.normpath(f"chapters/{path}").removesuffix(".md") + ".html"
        else:
            url = base + page
        return f"]({url}#{anchor})" if anchor else f"]({url})"

    return LINK.sub(replace, text)


def collapsed(cell: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A folded or removed code cell as a Colab form that shows its title, not its code."""
    prompt = cell.metadata.get("mystnb", {}).get("code_prompt_show", "")
    first = cell.source.split("\n", 1)[0]
    tags = set(cell.metadata.get("tags", []))
    if prompt and "{type}" not in prompt:
        title = prompt
    elif first.startswith("# "):
        title = first.removeprefix("# ")
    else:
        title = UNTITLED if tags & {"remove-cell"} else "The code of the output below"
    cell.source = f"# @title {title}\n" + cell.source
    cell.metadata["cellView"] = "form"
    cell.metadata["jupyter"] = {"source_hidden": True}
    return cell


def as_built(values: dict[str, str]) -> Render:
    """Glued values written as the book prints them (myst-nb's own formatting)."""
    from myst_nb.core.variables import format_plain_text

    return lambda name, spec: format_plain_text(values[name], spec)


def colab_notebook(chapter: Path, glue: Render) -> nbformat.NotebookNode:
    """The Colab notebook of `chapter` (its `.ipynb`), each glued value written by `glue`."""
    notebook = nbformat.read(chapter, as_version=4)
    labels, terms = citation_labels(ROOT / "book" / "references.bib"), glossary_terms()
    page = f"chapters/{chapter.stem}.html"
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            cell.source = absolute_links(substitute_roles(cell.source, glue, labels), page, terms)
            raw = ROLE.findall(cell.source) + DIRECTIVE.findall(cell.source)
            if raw:
                raise SystemExit(f"{chapter.name}: no Colab form for MyST {raw}")
        elif cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            if FOLDED & set(cell.metadata.get("tags", [])):
                collapsed(cell)
    notebook.metadata.pop("jupytext", None)
    notebook.metadata["colab"] = {"provenance": [], "toc_visible": True}
    return notebook


def written_values(chapter: Path, colab: Path) -> list[tuple[str, str]] | None:
    """Each glued value the Colab notebook `colab` writes into chapter `chapter`'s prose, as
    ("name:format", text) in order; None where its Markdown or cells are not the chapter's."""
    expected = colab_notebook(chapter, lambda name, spec: f"\0{name}:{spec}\0")
    committed = nbformat.read(colab, as_version=4)
    if len(expected.cells) != len(committed.cells):
        return None
    values = []
    for want, have in zip(expected.cells, committed.cells, strict=True):
        if want.cell_type != have.cell_type or want.metadata != have.metadata:
            return None
        if want.cell_type != "markdown":
            if want.source != have.source or have.get("outputs"):
                return None
            continue
        pieces = want.source.split("\0")  # text, name, text, name, ..., text
        pattern = "(.+?)".join(re.escape(text) for text in pieces[::2])
        found = re.fullmatch(pattern, have.source, re.DOTALL)
        if not found:
            return None
        values += zip(pieces[1::2], found.groups(), strict=True)
    return values


def write_all(build: Path = BUILD, out: Path = OUT) -> list[Path]:
    """Write every chapter's Colab notebook into `out`, from the executed notebooks of `build`."""
    out.mkdir(exist_ok=True)
    written = []
    for chapter in sorted((ROOT / "chapters").glob("[0-9A-Z][0-9]_*.ipynb")):
        notebook = colab_notebook(chapter, as_built(glued(build, chapter.stem)))
        nbformat.write(notebook, out / chapter.name)
        written.append(out / chapter.name)
    return written


if __name__ == "__main__":
    for path in write_all():
        print(path.relative_to(ROOT))
