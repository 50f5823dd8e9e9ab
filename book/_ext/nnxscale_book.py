"""Sphinx extension of the book: chapters re-executed when stale, a software/devices table,
MathJax served from the book itself, no duplicated inline scripts, treescope outputs that
load whatever the page's parsing speed, figures at twice their size, API names linked to their
documentation and the library's names and files to their source, figure numbers in
`[Figure](#name)` links, and author-year labels in the bibliography.

Chapters are executed through jupyter-cache (`execute_notebooks: cache`), which keys a
chapter's outputs on its code cells. The outputs also depend on the library under src/, the
pinned packages and the device count, so when any of those changed since the last build the
cache is emptied, and every chapter executes again; a chapter whose last execution failed is
read again, and executes again. `jupyter-book build .` is then never stale, and an edit to a
chapter's prose alone executes nothing.

Before Sphinx reads the chapters, the ones the cache holds no outputs for are executed by
jupyter-cache's executor, a chapter (and its kernel) per core at a time, and myst-nb then
reads each chapter's outputs from the cache.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging as stdlib_logging
import os
import re
import shutil
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from ctypes.util import find_library
from functools import partial
from pathlib import Path

import nbformat
from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.errors import ExtensionError
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

from nnxscale.core.show import BOOK_BUILD_ENV
from nnxscale.runtime.launch import run

CHAPTERS = "chapters/"
STATUS_PAGE = "book/status"
INPUTS = ("src/nnxscale/**/*", "requirements.txt", "pyproject.toml")
STAMP = "nnxscale-inputs.sha256"
"""The file in the cache folder that holds the digest of the inputs its outputs were made of."""
logger = logging.getLogger(__name__)


def inputs_digest(root: Path) -> str:
    """Hash of what chapter outputs depend on besides their own code: every file of the
    library (its Python and its calculator's script), the pins and the device count."""
    digest = hashlib.sha256(os.environ.get("NNXSCALE_DEVICES", "").encode())
    for pattern in INPUTS:
        for path in sorted(root.glob(pattern)):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def chapter_cache(app: Sphinx) -> object:
    """jupyter-cache's cache of the chapters' outputs, emptied when the inputs changed since
    they were executed: the digest of those inputs is kept beside them, so it outlives a
    `jupyter-book clean` (which keeps the cache) and a build that failed."""
    from jupyter_cache import get_cache

    cache = get_cache(app.config.nb_execution_cache_path)
    digest = inputs_digest(Path(app.srcdir))
    stamp = Path(cache.path) / STAMP
    if not stamp.exists() or stamp.read_text() != digest:
        cache.clear_cache()
        (Path(cache.path) / STAMP).write_text(digest)
    return cache


def _notebook(env: BuildEnvironment, doc: str) -> object:
    """A chapter as myst-nb reads it (what jupyter-cache matches outputs against)."""
    from myst_nb.core.read import read_myst_markdown_notebook

    path = Path(env.doc2path(doc))
    return read_myst_markdown_notebook(path.read_text(), add_source_map=True, path=str(path))


def outdated_chapters(
    app: Sphinx, env: BuildEnvironment, added: set, changed: set, removed: set
) -> list[str]:
    """Chapters to read again: those the cache holds no outputs for (after new inputs, a
    failed execution, or an edit to their code), and with them the status page."""
    cache = chapter_cache(app)
    stale = []
    for doc in sorted(d for d in env.found_docs if d.startswith(CHAPTERS)):
        try:
            cache.match_cache_notebook(_notebook(env, doc))
        except KeyError:
            stale.append(doc)
    return [*stale, STATUS_PAGE] if stale or added or changed else []


MYST_NOTEBOOK = {"type": "plugin", "name": "myst_nb_md"}
"""How jupyter-cache reads a MyST chapter: myst-nb's reader plugin."""


def execute_chapters(app: Sphinx, env: BuildEnvironment, docnames: list[str]) -> None:
    """Execute the chapters about to be read that the cache holds no outputs for, with
    jupyter-cache's executor, a chapter per core at a time; a chapter that fails stops the
    build here, with its traceback.

    Each core's thread takes the next chapter as soon as it is free, the longest first
    (`longest_first`). (jupyter-cache's `local-parallel` executor hands its processes fixed
    pairs of chapters, which on two cores left one idle at the end: a cold build took 217 s
    against 196 s this way.)"""
    config = app.config
    if config.nb_execution_mode != "cache":
        return
    cache = chapter_cache(app)
    kernels = {**shared_compilation(Path(cache.path).parent / COMPILED), **faster_malloc()}
    for name, value in kernels.items():
        os.environ.setdefault(name, value)  # the kernels inherit it, and what they start
    paths = [str(env.doc2path(doc)) for doc in docnames if doc.startswith(CHAPTERS)]
    records = [cache.add_nb_to_project(path, read_data=MYST_NOTEBOOK) for path in paths]
    pending = cache.list_unexecuted(filter_pks=[r.pk for r in records])
    if not pending:
        return
    pending = longest_first(pending, recorded_seconds())
    names = ", ".join(Path(r.uri).stem for r in pending)
    logger.info(f"executing {len(pending)} chapter(s) with jupyter-cache, one per core: {names}")
    with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
        failed = [uri for done in pool.map(partial(_execute, config), pending) for uri in done]
    reports = [f"{uri}:\n{cache.get_project_record(uri).traceback}" for uri in failed]
    if reports and config.nb_execution_raise_on_error:
        raise ExtensionError("executing a chapter failed:\n" + "\n\n".join(reports))
    for report in reports:  # myst-nb executes these again as it reads them, and reports
        logger.warning(f"executing a chapter failed: {report}")


COMPILED = ".jax_cache"
"""The folder, beside the chapters' outputs, where a build keeps the programs JAX compiled."""


def shared_compilation(folder: Path) -> dict[str, str]:
    """The environment in which the chapters' kernels, and the processes they start, share
    JAX's persistent compilation cache in `folder`: a program one chapter compiled (the model's
    initialisers, which every chapter runs, or a step two chapters compile alike) is read
    back by the next instead of compiled again, which takes about a tenth off the chapters'
    time on 2 cores. Every program is kept, however quick to compile; the size limit makes
    JAX lock the folder while it reads or writes (with `filelock`), so that two kernels never
    read a program half-written. A build after `jupyter-book clean --all` starts empty."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(folder.resolve()),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "JAX_COMPILATION_CACHE_MAX_SIZE": str(2**30),
    }


def faster_malloc(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`LD_PRELOAD` of jemalloc for the chapters' kernels, where it is installed (Debian's
    `libjemalloc2`) and nothing else is preloaded; otherwise nothing. XLA's compiler, which
    takes most of a chapter's time, allocates and frees small objects by the million, and
    glibc's malloc spent about a sixth of chapter 4's CPU time in them: with jemalloc the
    chapter ran in 28.1 s against 32.3 s here (benchmarks/build_time.py measures both).
    `NNXSCALE_JEMALLOC=0` turns it off."""
    library = find_library("jemalloc")
    if library is None or environ.get("LD_PRELOAD") or environ.get("NNXSCALE_JEMALLOC") == "0":
        return {}
    return {"LD_PRELOAD": library}


SECONDS = Path(__file__).with_name("chapter_seconds.json")
"""Each chapter's execution time in the build that `benchmarks/build_time.py --record` last
timed: only the order in which the chapters start depends on it."""


def recorded_seconds(path: Path = SECONDS) -> dict[str, float]:
    """The recorded execution time of each chapter, by file stem (none if no record)."""
    return json.loads(path.read_text()) if path.exists() else {}


def longest_first(records: list, seconds: dict[str, float]) -> list:
    """The chapters' cache records in the order to start them: a chapter without a recorded
    time first (it may be the longest), then the longest recorded first. Started in source
    order, the longest chapter could start last, while the other core idles at the end."""
    return sorted(records, key=lambda r: -seconds.get(Path(r.uri).stem, float("inf")))


def _execute(config: object, record: object) -> list[str]:
    """Execute one chapter of the cache's project with jupyter-cache's executor, caching its
    outputs; the URIs of what failed (none, or this chapter)."""
    from jupyter_cache import get_cache
    from jupyter_cache.executors import load_executor

    cache = get_cache(config.nb_execution_cache_path)  # a database connection per thread
    executor = load_executor("local-serial", cache, logger=stdlib_logging.getLogger(__name__))
    result = executor.run_and_cache(
        filter_pks=[record.pk],
        timeout=config.nb_execution_timeout,
        allow_errors=config.nb_execution_allow_errors,
    )
    return [*result.excepted, *result.errored]


def downloads_with_outputs(app: Sphinx, doctree: nodes.document) -> None:
    """Write a chapter's executed notebook, outputs and all, where the download button takes
    it from: myst-nb writes a chapter read from the cache there without its outputs."""
    from jupyter_cache import get_cache

    docname = app.env.docname
    if not docname.startswith(CHAPTERS) or app.config.nb_execution_mode != "cache":
        return
    notebook = _notebook(app.env, docname)
    _, executed = get_cache(app.config.nb_execution_cache_path).merge_match_into_notebook(notebook)
    target = Path(app.outdir).parent / "jupyter_execute" / f"{docname}.ipynb"
    target.write_text(nbformat.writes(executed))


class EnvironmentTable(SphinxDirective):
    """`nnxscale-environment`: the package versions and JAX devices of this build."""

    def run(self) -> list[nodes.Node]:
        from nnxscale import environment
        from nnxscale.runtime.devices import emulate_devices

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


JAX = "https://docs.jax.dev/en/latest/_autosummary/"
NNX = "https://flax.readthedocs.io/en/latest/api_reference/flax.nnx/"
ORBAX = "https://orbax.readthedocs.io/en/latest/api_reference/"
API_DOCS = {
    **{
        name: f"{JAX}{name}.html"
        for name in (
            "jax.jit",
            "jax.shard_map",
            "jax.set_mesh",
            "jax.make_mesh",
            "jax.device_put",
            "jax.devices",
            "jax.device_count",
            "jax.eval_shape",
            "jax.checkpoint",
            "jax.ShapeDtypeStruct",
            "jax.typeof",
            "jax.distributed.initialize",
            "jax.lax.scan",
            "jax.lax.with_sharding_constraint",
            "jax.lax.psum",
            "jax.lax.psum_scatter",
            "jax.lax.all_gather",
            "jax.lax.ppermute",
            "jax.lax.pvary",
            "jax.lax.all_to_all",
            "jax.sharding.NamedSharding",
            "jax.sharding.PartitionSpec",
            "jax.sharding.Mesh",
            "jax.sharding.AbstractMesh",
            "jax.numpy.where",
        )
    },
    **{
        f"nnx.{name}": f"{NNX}{page}.html#flax.nnx.{name}"
        for page, names in {
            "transforms": ("jit", "grad", "value_and_grad", "scan", "remat", "eval_shape"),
            "graph": ("split", "merge", "state", "update", "graphdef"),
            "variables": ("Param", "Variable", "with_partitioning", "get_partition_spec"),
            "rnglib": ("Rngs",),
            "state": ("State",),
            "module": ("Module",),
        }.items()
        for name in names
    },
    "nnx.Optimizer": f"{NNX}training/optimizer.html#flax.nnx.optimizer.Optimizer",
    "ocp.CheckpointManager": f"{ORBAX}checkpoint.checkpoint_manager.html",
}
"""Documentation pages of the JAX, Flax NNX and Orbax names the chapters mention."""
SHORT_NAMES = {
    "shard_map": "jax.shard_map",
    "ppermute": "jax.lax.ppermute",
    "psum": "jax.lax.psum",
    "psum_scatter": "jax.lax.psum_scatter",
    "all_gather": "jax.lax.all_gather",
    "pvary": "jax.lax.pvary",
    "NamedSharding": "jax.sharding.NamedSharding",
    "PartitionSpec": "jax.sharding.PartitionSpec",
    "with_sharding_constraint": "jax.lax.with_sharding_constraint",
    "jnp.where": "jax.numpy.where",
    "jax.distributed": "jax.distributed.initialize",
    "jax.remat": "jax.checkpoint",
}
"""Names written without their module, and what they stand for."""


def _repository(app: Sphinx) -> tuple[str, str]:
    options = app.config.html_theme_options
    return options.get("repository_url", ""), options.get("repository_branch", "main")


def _library_source(name: str) -> tuple[str, int] | None:
    """The file (relative to the repository) and line where `nx.<name>` is defined."""
    import nnxscale

    target: object = nnxscale
    try:
        for part in name.split("."):
            target = getattr(target, part)
        target = inspect.unwrap(target)
        path = Path(inspect.getsourcefile(target) or "")
        line = inspect.getsourcelines(target)[1] if not inspect.ismodule(target) else 0
    except (AttributeError, TypeError, OSError):
        return None
    root = Path(nnxscale.__file__).parent.parent.parent
    return (str(path.relative_to(root)), line) if path.is_relative_to(root) else None


def link_target(text: str, app: Sphinx) -> str | None:
    """Where inline code `text` should link: API docs, the library's source, a repository file."""
    name = re.sub(r"\(.*\)$", "", text.strip())
    name = SHORT_NAMES.get(name, name)
    if name in API_DOCS:
        return API_DOCS[name]
    repository, branch = _repository(app)
    if not repository:
        return None
    for prefix in ("nx.", "nnxscale."):
        if name.startswith(prefix) and (found := _library_source(name.removeprefix(prefix))):
            path, line = found
            return f"{repository}/blob/{branch}/{path}" + (f"#L{line}" if line else "")
    tracked = _tracked_files(str(app.srcdir))
    if "/" in text and text.rstrip("/") in tracked:
        kind = "tree" if tracked[text.rstrip("/")] else "blob"
        return f"{repository}/{kind}/{branch}/{text.rstrip('/')}"
    return None


@functools.cache
def _tracked_files(root: str) -> dict[str, bool]:
    """Files and folders git tracks under `root`, each mapped to whether it is a folder (none
    outside a git checkout, or without git: the names then stay unlinked)."""
    listed = run(["git", "ls-files"], cwd=root, check=False)
    files = listed.text.split() if listed.returncodes == [0] else []
    folders = {str(parent) for f in files for parent in Path(f).parents if str(parent) != "."}
    return {**dict.fromkeys(files, False), **dict.fromkeys(folders, True)}


def link_literals(app: Sphinx, doctree: nodes.document) -> None:
    """Link inline code naming a JAX/Flax/Orbax API, a library name, or a repository file."""
    for literal in list(doctree.findall(nodes.literal)):
        if isinstance(literal.parent, nodes.reference | nodes.literal_block):
            continue
        url = link_target(literal.astext(), app)
        if url:
            reference = nodes.reference("", "", refuri=url, internal=False, classes=["api-link"])
            literal.replace_self(reference)
            reference += literal


def number_figure_links(app: Sphinx, doctree: nodes.document, docname: str) -> None:
    """`[Figure](#fig-x)` reads "Figure 3.2" in the book (and plain "Figure" in Colab)."""
    numbers = app.env.toc_fignumbers
    for reference in doctree.findall(nodes.reference):
        if reference.astext() != "Figure" or not ("refuri" in reference or "refid" in reference):
            continue
        target = reference.get("refid") or reference["refuri"]
        page, _, anchor = target.rpartition("#")
        doc = docname if not page else _docname(app, docname, page)
        number = numbers.get(doc, {}).get("figure", {}).get(anchor)
        if number:
            text = "Figure " + ".".join(map(str, number))
            reference.children = [nodes.inline(text, text)]


def colab_opens_its_notebook(
    app: Sphinx, pagename: str, templatename: str, context: dict, doctree
) -> None:
    """The Colab button opens `colab/NN_slug.ipynb` (written by book/colab.py), which reads
    right in Colab, not the chapter's jupytext pair with its MyST roles."""
    for group in context.get("header_buttons", []):
        for button in group.get("buttons", []):
            if button.get("text") == "Colab" and "/chapters/" in button["url"]:
                head, _, name = button["url"].rpartition("/chapters/")
                button["url"] = f"{head}/colab/{name}"


def _docname(app: Sphinx, current: str, uri: str) -> str:
    """The document a relative HTML link from `current` points at."""
    base = Path(current).parent
    target = os.path.normpath(base / uri.removesuffix(app.builder.out_suffix))
    return target.replace(os.sep, "/")


def _bibliography_style() -> type:
    """The pybtex style that labels entries as cited in the text: "Huang et al., 2019"."""
    from pybtex.plugin import PluginNotFound, find_plugin, register_plugin
    from pybtex.style.formatting.unsrt import Style as Unsorted
    from pybtex.style.labels import BaseLabelStyle

    class AuthorYear(BaseLabelStyle):
        def format_labels(self, entries):
            labels = []
            for entry in entries:
                people = entry.persons.get("author") or entry.persons.get("editor") or []
                last = [" ".join(p.last_names).strip("{}") for p in people]
                last = last or [entry.fields.get("title", "")]
                names = (
                    last[0]
                    if len(last) == 1
                    else (f"{last[0]} and {last[1]}" if len(last) == 2 else f"{last[0]} et al.")
                )
                labels.append(f"{names}, {entry.fields.get('year', '')}".strip(", "))
            # the same authors and year twice: 2021a, 2021b, in bibliography order
            repeated = {label for label in labels if labels.count(label) > 1}
            seen: dict[str, int] = {}
            for label in labels:
                if label in repeated:
                    seen[label] = seen.get(label, 0) + 1
                    label += "abcdefghijklmnopqrstuvwxyz"[seen[label] - 1]
                yield label

    class Style(Unsorted):
        default_label_style = "nnxscale-author-year"
        default_sorting_style = "author_year_title"

    try:
        return find_plugin("pybtex.style.formatting", "nnxscale")
    except PluginNotFound:  # not registered yet in this process
        register_plugin("pybtex.style.labels", "nnxscale-author-year", AuthorYear)
        register_plugin("pybtex.style.formatting", "nnxscale", Style)
        return Style


def author_year_labels(app: Sphinx, config: object) -> None:
    """Bibliography entries labelled as cited in the text: "Huang et al., 2019", not [HCB+19]."""
    _bibliography_style()
    config.bibtex_default_style = "nnxscale"


def citation_labels(bib: Path) -> dict[str, str]:
    """Each entry of `bib` and its label, as the references page (`:all:`) labels it."""
    from pybtex.database import parse_file

    style = _bibliography_style()()
    entries = style.sort(parse_file(bib).entries.values())
    return dict(zip([entry.key for entry in entries], style.format_labels(entries), strict=True))


def glossary_terms_any_case(app: Sphinx, env: BuildEnvironment) -> None:
    """Let `[FSDP](#fsdp)` find the glossary term "FSDP": MyST looks terms up in lower case,
    while Sphinx 7.4 records them as written."""
    objects = env.get_domain("std").objects
    for (kind, name), where in list(objects.items()):
        if kind == "term":
            objects.setdefault((kind, name.lower()), where)


def sharp_figures(app: Sphinx, config: object) -> None:
    """Kernels draw matplotlib figures at twice their size (sharp on high-DPI screens): an
    IPython profile of the build's own asks the inline backend for the 'retina' format."""
    profile = Path(app.outdir).parent / ".ipython" / "profile_default"
    profile.mkdir(parents=True, exist_ok=True)
    (profile / "ipython_kernel_config.py").write_text(
        'c.InlineBackend.figure_formats = {"retina"}\n'
    )
    os.environ["IPYTHONDIR"] = str(profile.parent)


def setup(app: Sphinx) -> dict[str, object]:
    # Kernels started by myst-nb inherit this: `nnxscale.show.glue` records values only then.
    os.environ[BOOK_BUILD_ENV] = "1"
    app.connect("config-inited", author_year_labels)
    app.connect("config-inited", sharp_figures)
    app.connect("doctree-read", link_literals)
    app.connect("env-updated", glossary_terms_any_case)
    app.connect("doctree-resolved", number_figure_links)
    app.connect("html-page-context", colab_opens_its_notebook, priority=502)  # after the theme
    app.add_js_file("nnxscale-search.js")
    app.add_js_file("nnxscale-tables.js")
    app.connect("doctree-resolved", defer_treescope)
    app.connect("env-get-outdated", outdated_chapters)
    app.connect("env-before-read-docs", execute_chapters)
    app.connect("doctree-read", downloads_with_outputs)
    app.connect("config-inited", use_local_mathjax)
    app.connect("build-finished", copy_mathjax)
    # Early: Sphinx stops calling html-page-context handlers at the first that returns a value.
    app.connect("html-page-context", dedupe_scripts, priority=100)
    app.add_directive("nnxscale-environment", EnvironmentTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 1}
