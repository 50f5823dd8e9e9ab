"""The book's Sphinx extension, function by function (its work in a real build: test_book)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from nnxscale import launch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "book" / "_ext"))
import nnxscale_book as ext


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "src" / "nnxscale" / "__pycache__").mkdir(parents=True)
    (tmp_path / "src" / "nnxscale" / "mod.py").write_text("x = 1\n")
    (tmp_path / "src" / "nnxscale" / "calculator.js").write_text("let x = 1;\n")
    (tmp_path / "requirements.txt").write_text("jax==0.10.2\n")
    return tmp_path


def test_digest_follows_the_library_the_pins_and_the_device_count(tree, monkeypatch) -> None:
    monkeypatch.delenv("NNXSCALE_DEVICES", raising=False)
    digests = [ext.inputs_digest(tree)]
    (tree / "src" / "nnxscale" / "__pycache__" / "mod.pyc").write_bytes(b"compiled")
    assert ext.inputs_digest(tree) == digests[0]  # what Python caches is not an input
    (tree / "src" / "nnxscale" / "mod.py").write_text("x = 2\n")
    digests.append(ext.inputs_digest(tree))
    (tree / "src" / "nnxscale" / "calculator.js").write_text("let x = 2;\n")
    digests.append(ext.inputs_digest(tree))
    (tree / "requirements.txt").write_text("jax==0.10.3\n")
    digests.append(ext.inputs_digest(tree))
    monkeypatch.setenv("NNXSCALE_DEVICES", "16")
    digests.append(ext.inputs_digest(tree))
    assert len(set(digests)) == 5


def test_chapters_start_longest_first_and_an_untimed_one_before_all() -> None:
    records = [
        SimpleNamespace(uri=f"/book/chapters/{n}.md") for n in ("01_a", "02_b", "03_c", "04_d")
    ]
    seconds = {"01_a": 5.0, "02_b": 40.0, "04_d": 20.0}  # 03_c is new: never timed
    order = [Path(r.uri).stem for r in ext.longest_first(records, seconds)]
    assert order == ["03_c", "02_b", "04_d", "01_a"]
    assert [Path(r.uri).stem for r in ext.longest_first(records, {})] == [
        "01_a",
        "02_b",
        "03_c",
        "04_d",
    ]  # no record: the source order


def test_the_recorded_times_are_of_the_books_chapters() -> None:
    chapters = {p.stem for p in (ROOT / "chapters").glob("*.md")}
    recorded = ext.recorded_seconds()
    assert set(recorded) == chapters, "run benchmarks/build_time.py --record"
    assert all(seconds > 0 for seconds in recorded.values())


PROGRAM_READER = """
import json, sys
import nnxscale as nx
nx.emulate_devices()
import jax
hits = []
jax.monitoring.register_event_listener(
    lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None
)
options = nx.TrainOptions(dropout=False, compiler_options=nx.devices.FAST_COMPILE)
trainer = nx.trainer_for(nx.FSDP, model=nx.TINY, options=options)
batches = nx.book_batches(batch_size=2 * jax.device_count())
program = trainer.compile(trainer.batch(batches))
report = nx.collectives(program)
print(json.dumps({
    "hits": len(hits),
    "temp": program.memory_analysis().temp_size_in_bytes,
    "flops": program.cost_analysis()["flops"],
    "collectives": sorted((c.kind, c.array_bytes, c.executions) for c in report.collectives),
    "losses": trainer.train(batches, 2),
}))
"""


@pytest.mark.slow
def test_a_program_read_back_from_the_shared_cache_is_the_program_compiled(tmp_path) -> None:
    """What a chapter reads off a compiled program is the same when a chapter before it
    compiled the program and the build's shared compilation cache hands it back."""
    env = {**os.environ, **ext.shared_compilation(tmp_path / "jax")}
    runs = [
        json.loads(
            launch.run([sys.executable, "-c", PROGRAM_READER], 4, env=env).text.splitlines()[-1]
        )
        for _ in range(2)
    ]
    assert runs[0]["hits"] == 0 and runs[1]["hits"] > 0  # all compiled, then read back
    first, second = ({k: v for k, v in r.items() if k != "hits"} for r in runs)
    assert first == second
    assert first["collectives"]  # FSDP's gathers and reductions, counted in both


def test_the_shared_cache_is_locked_and_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = ext.shared_compilation(Path("_build") / ext.COMPILED)
    assert Path(env["JAX_COMPILATION_CACHE_DIR"]).is_absolute()  # kernels run elsewhere
    assert int(env["JAX_COMPILATION_CACHE_MAX_SIZE"]) > 0  # a limit: JAX locks the folder
    import filelock  # what JAX locks it with

    assert filelock.FileLock


def test_kernels_get_jemalloc_where_installed_and_nothing_else_is_preloaded(monkeypatch) -> None:
    monkeypatch.setattr(ext, "find_library", lambda name: None)
    assert ext.faster_malloc({}) == {}  # not installed: glibc's malloc, as before
    monkeypatch.setattr(ext, "find_library", lambda name: f"lib{name}.so.2")
    assert ext.faster_malloc({}) == {"LD_PRELOAD": "libjemalloc.so.2"}
    assert ext.faster_malloc({"LD_PRELOAD": "libtcmalloc.so.4"}) == {}  # the reader's own
    assert ext.faster_malloc({"NNXSCALE_JEMALLOC": "0"}) == {}  # turned off
    assert "libjemalloc2" in (ROOT / ".ci" / "setup").read_text()  # CI builds with it


JEMALLOC_PROBE = """
import json
import nnxscale as nx
nx.emulate_devices(4)
import jax, jax.numpy as jnp
maps = [line.split()[-1] for line in open("/proc/self/maps") if "jemalloc" in line]
x = jnp.arange(64.0).reshape(8, 8)
print(json.dumps({"jemalloc": bool(maps), "sum": float(jax.jit(lambda a: (a @ a).sum())(x))}))
"""


@pytest.mark.slow
def test_a_kernel_under_jemalloc_loads_it_and_computes_alike() -> None:
    if not ext.faster_malloc({}):
        pytest.skip("jemalloc is not installed here (Debian: libjemalloc2; .ci/setup installs it)")
    runs = [
        json.loads(
            launch.run([sys.executable, "-c", JEMALLOC_PROBE], env=env).text.splitlines()[-1]
        )
        for env in ({**os.environ, **ext.faster_malloc({})}, {**os.environ, "LD_PRELOAD": ""})
    ]
    assert [r["jemalloc"] for r in runs] == [True, False]
    assert runs[0]["sum"] == runs[1]["sum"]


def test_treescope_outputs_are_inserted_only_once_parsed() -> None:
    from docutils import nodes
    from docutils.utils import new_document

    doctree = new_document("chapter")
    treescope = "<treescope-container></treescope-container><treescope-run-here><script>x</script></treescope-run-here>"  # noqa: E501
    doctree += nodes.raw("", treescope, format="html")
    doctree += nodes.raw("", "<b>plain</b>", format="html")
    ext.defer_treescope(None, doctree, "chapter")
    first, second = doctree.children
    assert first.astext().startswith('<div class="nnxscale-deferred"><template>' + treescope)
    assert "document.importNode" in first.astext()
    assert second.astext() == "<b>plain</b>"


def fake_app(srcdir: Path = ROOT):
    options = {"repository_url": "https://github.com/o/r", "repository_branch": "main"}
    return SimpleNamespace(config=SimpleNamespace(html_theme_options=options), srcdir=srcdir)


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("jax.shard_map", "https://docs.jax.dev/en/latest/_autosummary/jax.shard_map.html"),
        ("shard_map", "https://docs.jax.dev/en/latest/_autosummary/jax.shard_map.html"),
        ("jax.lax.ppermute()", "https://docs.jax.dev/en/latest/_autosummary/jax.lax.ppermute.html"),
        ("nnx.Rngs", ext.NNX + "rnglib.html#flax.nnx.Rngs"),
        ("benchmarks/fsdp.py", "https://github.com/o/r/blob/main/benchmarks/fsdp.py"),
        ("src/nnxscale/", "https://github.com/o/r/tree/main/src/nnxscale"),
        ("nx.hlo", "https://github.com/o/r/blob/main/src/nnxscale/analysis/hlo.py"),
        ("model", None),
        ("a/b/not-a-file.py", None),
    ],
)
def test_inline_code_links_to_docs_source_and_files(text: str, url: str | None) -> None:
    assert ext.link_target(text, fake_app()) == url


def test_library_names_link_to_the_line_that_defines_them() -> None:
    import inspect

    import nnxscale as nx

    url = ext.link_target("nx.Trainer.create", fake_app())
    line = inspect.getsourcelines(nx.Trainer.create)[1]
    assert url == f"https://github.com/o/r/blob/main/src/nnxscale/train/trainer.py#L{line}"


def test_bibliography_labels_read_like_the_citations() -> None:
    from pybtex.database import parse_string
    from pybtex.plugin import find_plugin

    config = SimpleNamespace()
    ext.author_year_labels(None, config)
    style = find_plugin("pybtex.style.formatting", config.bibtex_default_style)()
    entries = parse_string(
        "@misc{a, author={Huang, Yanping and Cheng, Youlong and Bapna, Ankur}, year={2019},"
        " title={GPipe}}\n@misc{b, author={Austin, Jacob and Douglas, Sholto}, year={2025},"
        " title={Scaling}}\n@misc{c, author={Xu, Yuanzhong}, year={2021}, title={GSPMD}}"
        "@misc{d, author={Xu, Yuanzhong}, year={2021}, title={More}}"
        "@misc{e, author={{The JAX authors}}, year={2024}, title={JAX}}",
        "bibtex",
    )
    labels = [e.label for e in style.format_entries(entries.entries.values())]
    assert labels == [
        "Austin and Douglas, 2025", "Huang et al., 2019", "Xu, 2021a", "Xu, 2021b",
        "The JAX authors, 2024",  # sorted as written, "{The", and labelled without braces
    ]  # fmt: skip
    assert ext.citation_labels  # the Colab notebooks label citations with this same style


def test_outside_a_git_checkout_paths_stay_unlinked(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "fsdp.py").write_text("")
    assert ext.link_target("benchmarks/fsdp.py", fake_app(tmp_path)) is None
    assert ext.link_target("jax.jit", fake_app(tmp_path)) == ext.JAX + "jax.jit.html"


def test_the_colab_button_opens_the_notebook_written_for_colab() -> None:
    colab = "https://colab.research.google.com/github/o/r/blob/main/chapters/01_device_meshes.ipynb"
    context = {"header_buttons": [
        {"type": "group", "buttons": [{"text": "Colab", "url": colab},
                                      {"text": "Binder", "url": "https://b/chapters/x"}]},
        {"type": "link", "url": "https://github.com/o/r"},
    ]}  # fmt: skip
    ext.colab_opens_its_notebook(None, "chapters/01_device_meshes", "page.html", context, None)
    buttons = context["header_buttons"][0]["buttons"]
    assert buttons[0]["url"].endswith("/blob/main/colab/01_device_meshes.ipynb")
    assert buttons[1]["url"] == "https://b/chapters/x"
