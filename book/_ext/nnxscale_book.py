"""Sphinx extension of the book: chapters re-executed when stale, a software/devices table,
MathJax served from the book itself, no duplicated inline scripts, and treescope outputs that
load whatever the page's parsing speed.

Sphinx re-reads (so myst-nb re-executes) only documents whose source changed. The chapters'
outputs also depend on the library under src/, the pinned packages and the device count, so
when any of those changed since the last build, or a chapter's last execution failed, every
affected chapter is executed again. `jupyter-book build .` is then never stale.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util.docutils import SphinxDirective

from nnxscale.display import BOOK_BUILD_ENV

CHAPTERS = "chapters/"
STATUS_PAGE = "book/status"
INPUTS = ("src/**/*.py", "requirements.txt", "pyproject.toml")


def inputs_digest(root: Path) -> str:
    """Hash of what chapter outputs depend on besides their own source."""
    digest = hashlib.sha256(os.environ.get("NNXSCALE_DEVICES", "").encode())
    for pattern in INPUTS:
        for path in sorted(root.glob(pattern)):
            digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def outdated_chapters(
    app: Sphinx, env: BuildEnvironment, added: set, changed: set, removed: set
) -> list[str]:
    """Chapters to execute again: all when the inputs changed, else those that failed last time."""
    from myst_nb.sphinx_ import NbMetadataCollector

    digest = inputs_digest(Path(app.srcdir))
    chapters = [doc for doc in env.found_docs if doc.startswith(CHAPTERS)]
    if getattr(env, "nnxscale_inputs_digest", None) != digest:
        stale = chapters
    else:
        stale = [
            doc
            for doc in chapters
            if not (NbMetadataCollector.get_exec_data(env, doc) or {}).get("succeeded", False)
        ]
    env.nnxscale_inputs_digest = digest
    return [*stale, STATUS_PAGE] if stale or added or changed else []


class EnvironmentTable(SphinxDirective):
    """`nnxscale-environment`: the package versions and JAX devices of this build."""

    def run(self) -> list[nodes.Node]:
        from nnxscale import environment
        from nnxscale.devices import emulate_devices

        emulate_devices()
        rows = {**environment.versions(), **environment.devices()}
        lines = ["| component | version or value |", "|---|---|"]
        lines += [f"| {k} | `{v}` |" for k, v in rows.items()]
        container = nodes.container()
        self.state.nested_parse(StringList(lines), self.content_offset, container)
        return container.children


def _mathjax_dir() -> Path | None:
    """MathJax 3's browser build, shipped by the django-static-mathjax wheel, if installed."""
    spec = importlib.util.find_spec("mathjax")
    if spec is None or not spec.submodule_search_locations:
        return None
    es5 = Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax" / "es5"
    return es5 if (es5 / "tex-mml-chtml.js").exists() else None


def use_local_mathjax(app: Sphinx, config: object) -> None:
    """Load MathJax from the book's own _static folder, so pages render math offline."""
    if _mathjax_dir() is not None:
        config.mathjax_path = "mathjax/tex-mml-chtml.js"


def copy_mathjax(app: Sphinx, exception: Exception | None) -> None:
    """Copy MathJax into the built HTML's _static folder."""
    source = _mathjax_dir()
    if exception is None and source is not None and app.builder.format == "html":
        shutil.copytree(source, Path(app.outdir) / "_static" / "mathjax", dirs_exist_ok=True)


def dedupe_scripts(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Drop inline scripts registered twice (sphinx-thebe's `const` would throw on a page)."""
    seen: set[tuple] = set()
    unique = []
    for script in context.get("script_files", []):
        # The same inline script comes once with filename None and once with "".
        name = getattr(script, "filename", script) or ""
        key = (str(name), tuple(sorted(getattr(script, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"][:] = unique


TREESCOPE_MARK = "<treescope-run-here>"
DEFERRED = (
    '<div class="nnxscale-deferred"><template>{html}</template><script>'
    "(()=>{{const box=document.currentScript.parentNode;"
    'box.replaceWith(document.importNode(box.querySelector("template").content,true));}})();'
    "</script></div>"
)


def defer_treescope(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    """Insert each treescope output only once it is fully parsed.

    Treescope's `<treescope-run-here>` runs its script when the element connects; while a page
    is being parsed it can connect before that script's text has arrived (on a busy machine
    the parser yields mid-script), and the output then stays blank with a page error. Inside a
    `<template>` the output is parsed inert, and a loader inserts it whole.
    """
    for node in doctree.findall(nodes.raw):
        text = node.astext()
        if "html" in node.get("format", "").split() and TREESCOPE_MARK in text:
            node.replace_self(nodes.raw("", DEFERRED.format(html=text), format="html"))


def setup(app: Sphinx) -> dict[str, object]:
    # Kernels started by myst-nb inherit this: `nnxscale.display.glue` records values only then.
    os.environ[BOOK_BUILD_ENV] = "1"
    app.connect("doctree-resolved", defer_treescope)
    app.connect("env-get-outdated", outdated_chapters)
    app.connect("config-inited", use_local_mathjax)
    app.connect("build-finished", copy_mathjax)
    # Early: Sphinx stops calling html-page-context handlers at the first that returns a value.
    app.connect("html-page-context", dedupe_scripts, priority=100)
    app.add_directive("nnxscale-environment", EnvironmentTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 1}
