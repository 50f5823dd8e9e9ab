""" "Run all" of each notebook the Colab links open (`colab/NN_slug.ipynb`), the way Colab runs
it, offline.

The kernel runs in a throwaway virtual environment that holds Python, a Jupyter kernel
(`KERNEL_PACKAGES`) and nothing else: no JAX, no Flax, no build tool. The setup cell must
install everything the chapter imports, as `pip install nnxscale` from a copy of this
checkout, which brings the package's declared dependencies. Packages come from a local
folder of wheels (the book's pinned versions, downloaded once), never from an index, so the
run is offline and the versions are the book's. A stub `google.colab` module is imported at
kernel start, as on Colab, so the setup cell takes its Colab branch, and JAX is told to use
a GPU that is not there, as on a Colab GPU runtime, so the setup cell must switch to CPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from nnxscale.runtime.launch import run

from book import CHAPTERS, KERNEL_PACKAGES, ROOT, copy_checkout

pytestmark = pytest.mark.sweep


def pinned(destination: Path) -> Path:
    """requirements.txt as a constraints file: every pin, without the editable install."""
    pins = [line for line in (ROOT / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith(("#", "-e"))]  # fmt: skip
    destination.write_text("\n".join(pins) + "\n")
    return destination


@pytest.fixture(scope="module")
def colab(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Colab-like kernel: a venv with only a kernel, a wheel folder, a google.colab stub."""
    base = tmp_path_factory.mktemp("colab")
    checkout = copy_checkout(base / "checkout")
    wheels = base / "wheels"
    # What the setup cell and the kernel may install, at the book's pinned versions.
    download = [sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels),
                "-c", str(pinned(base / "constraints.txt")), str(checkout), "setuptools",
                *KERNEL_PACKAGES]  # fmt: skip
    run(download, timeout=1200)
    venv = base / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    offline = ["--no-index", "--find-links", str(wheels), "--disable-pip-version-check"]
    install = [python, "-m", "pip", "install", "-q", *offline, *KERNEL_PACKAGES]
    run(install, timeout=1200)
    stub = base / "stub" / "google" / "colab"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('"""Stand-in for the module Colab imports at start."""\n')
    (stub / "output.py").write_text('"""Stand-in for google.colab.output, which JAX imports."""\n')
    startup = base / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-colab.py").write_text("import google.colab  # noqa: F401\n")
    kernel = base / "jupyter" / "kernels" / "colab"
    kernel.mkdir(parents=True)
    spec = {
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Colab (simulated)",
        "language": "python",
        "env": {
            "PYTHONPATH": str(base / "stub"),
            "IPYTHONDIR": str(base / "ipython"),
            "NNXSCALE_SOURCE": str(checkout),
            "PIP_NO_INDEX": "1",  # offline: only the wheel folder
            "PIP_FIND_LINKS": str(wheels),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "JAX_PLATFORMS": "cuda",  # a GPU runtime: the setup cell must switch to CPU
        },
    }
    (kernel / "kernel.json").write_text(json.dumps(spec))
    content = base / "content"
    content.mkdir()
    return {"jupyter": base / "jupyter", "content": content, "venv": venv}


def test_the_colab_kernel_has_a_kernel_and_nothing_else(colab: dict[str, Path]) -> None:
    python = colab["venv"] / "bin" / "python"
    for module in ("nnxscale", "jax", "flax", "matplotlib", "myst_nb", "jupyter_book"):
        probe = run([str(python), "-c", f"import {module}"], check=False)
        assert f"No module named '{module}'" in probe.text, module
    assert run([str(python), "-c", "import ipykernel, IPython"], check=False).returncodes == [0]


DEEPER = ("MODEL = nx.model.BENCH ", "MODEL = nx.model.BENCH.replace(layers=32) ")
TRY_IT = {  # chapter: (problem, cell's text, its edit, the answer right after it, at 8 devices)
    "01_device_meshes": (4, 'spec = P("data", None)', 'spec = P(None, "model")', "4"),
    "02_logical_axis_rules": (
        4,
        'edited", logical={**nx.FSDP.logical, "embed": ("data",)}',
        'edited", logical={**nx.FSDP.logical, "embed": ()}',
        "156_928",
    ),
    "03_sharded_init": (4, *DEEPER, "2"),
    "04_training_strategies": (4, *DEEPER, '{"FSDP"}'),
    "05_orbax_resharding": (
        4,
        "new_rules, new_mesh = nx.TP, nx.strategy_mesh(nx.TP)",
        "new_rules, new_mesh = nx.FSDP, nx.strategy_mesh(nx.FSDP, 2)",
        "1_116_692",
    ),
    "06_fsdp_from_scratch": (4, "LAYERS, N = cfg.layers, d", "LAYERS, N = 32, 256", "23_664_510"),
    "07_pipeline_schedules": (4, "M = 16 ", "M = 32 ", "3 / 35"),
    "08_multi_process": (4, "PROCESSES = 2 ", "PROCESSES = 4 ", "[12, 16]"),
    "09_sequence_and_context_parallelism": (5, "LENGTH = 4096 ", "LENGTH = 16_384 ", "16"),
    "10_expert_parallelism": (5, "FACTOR = 1.0 ", "FACTOR = 1.5 ", "52"),
    "11_where_the_time_goes": (5, "rows_per_device = 16\n", "rows_per_device = 64\n", "458_752"),
    "12_choosing_a_strategy": (
        5,
        'seven_8 = nx.plan(seven, 8, "H100", global_batch=64, seq=4096)',
        'seven_8 = nx.plan(seven, 8, "H100", global_batch=64, seq=4096, memory_per_device=40e9)',
        "2",
    ),
    "A1_your_own_model": (
        5,
        "tp_names = proposal.rules(nx.TP)",
        'tp_names = proposal.edit("blocks/0/up", ("embed", None)).rules(nx.TP)',
        "27_072",
    ),
    "A2_when_it_breaks": (3, "heads=3, kv_heads=1)", "heads=4, kv_heads=1)", '{"key", "value"}'),
}
"""Each chapter's "try it" problem as a reader follows it: the cell the problem names, the edit
it asks for, and the answer that is right once the edited cell has run."""


def run_cell(client: NotebookClient, notebook, cell) -> str:
    """Run `cell` again in the running kernel, as a reader does; its text and Markdown."""
    client.execute_cell(cell, notebook.cells.index(cell))
    return "".join(
        o.get("text", "") + o.get("data", {}).get("text/markdown", "") for o in cell.outputs
    )


@pytest.mark.parametrize("md", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_run_all_as_on_colab_then_try_it(
    colab: dict[str, Path], md: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run all; then the try-it problem: its right answer is refused before the edit the
    problem asks for, and taken once the edited cell has run again; and its solution, opened
    after the edit, still runs (it proves itself on its own edit, not the reader's)."""
    monkeypatch.setenv("JUPYTER_PATH", str(colab["jupyter"]))
    monkeypatch.delenv("NNXSCALE_DEVICES", raising=False)
    monkeypatch.delenv("NNXSCALE_BOOK_BUILD", raising=False)
    notebook = nbformat.read(ROOT / "colab" / f"{md.stem}.ipynb", as_version=4)  # as linked
    check = nbformat.v4.new_code_cell(
        "import jax, nnxscale\n"
        "print(jax.device_count(), jax.devices()[0].platform, nnxscale.__file__)"
    )
    notebook.cells.append(check)  # after "Run all": what did the notebook run on?
    client = NotebookClient(
        notebook, kernel_name="colab", timeout=600,
        resources={"metadata": {"path": str(colab["content"])}},
    )  # fmt: skip
    problem, before, after, answer = TRY_IT[md.stem]
    with client.setup_kernel():
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
        count, platform, location = check.outputs[0]["text"].split()
        assert (count, platform) == ("8", "cpu")
        assert str(colab["venv"]) in location  # installed by the setup cell, in the venv
        code = [c for c in notebook.cells if c.cell_type == "code"]
        (mine,) = [c for c in code if f"checks[{problem}](answer" in c.source]
        (edited,) = [c for c in code if before in c.source]
        mine.source = mine.source.replace("answer = None", f"answer = {answer}", 1)
        assert "**right.**" not in run_cell(client, notebook, mine)  # not before the edit
        edited.source = edited.source.replace(before, after)
        run_cell(client, notebook, edited)
        verdict = run_cell(client, notebook, mine)
        assert "**right.**" in verdict, verdict
        solution = notebook.cells[notebook.cells.index(mine) + 1]
        assert "The check takes this answer" in run_cell(client, notebook, solution)
