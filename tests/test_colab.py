""" "Run all" of each committed notebook, the way Colab runs it, offline.

The kernel runs in a throwaway virtual environment that sees this environment's packages (as
Colab's runtime has JAX, Flax and friends preinstalled) but not `nnxscale`. A stub
`google.colab` module is imported at kernel start, as on Colab, so the setup cell takes its
Colab branch: it pip-installs `nnxscale` (from a copy of this checkout, with no package index)
and forces the CPU platform although the kernel was told to use a GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from book import CHAPTERS, copy_checkout

pytestmark = pytest.mark.book


@pytest.fixture(scope="module")
def colab(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Colab-like kernel: throwaway venv, preinstalled packages, google.colab stub."""
    base = tmp_path_factory.mktemp("colab")
    venv = base / "venv"
    # No pip of its own: pip, setuptools and the rest come from the preinstalled packages below.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # Preinstalled packages, as on Colab; .pth files there are not run, so nnxscale's editable
    # install stays invisible.
    Path(site, "colab_preinstalled.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
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
            "NNXSCALE_SOURCE": str(copy_checkout(base / "checkout")),
            "PIP_NO_INDEX": "1",  # offline: everything else must already be installed
            "PIP_NO_BUILD_ISOLATION": "0",  # build with the preinstalled setuptools
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "JAX_PLATFORMS": "cuda",  # a GPU runtime: the setup cell must switch to CPU
        },
    }
    (kernel / "kernel.json").write_text(json.dumps(spec))
    content = base / "content"
    content.mkdir()
    return {"jupyter": base / "jupyter", "content": content, "venv": venv}


def test_the_colab_kernel_cannot_import_nnxscale_before_setup(colab: dict[str, Path]) -> None:
    probe = subprocess.run(
        [colab["venv"] / "bin" / "python", "-c", "import jax, flax, nnxscale"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert "No module named 'nnxscale'" in probe.stderr


@pytest.mark.parametrize("md", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_run_all_as_on_colab(
    colab: dict[str, Path], md: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JUPYTER_PATH", str(colab["jupyter"]))
    monkeypatch.delenv("NNXSCALE_DEVICES", raising=False)
    notebook = nbformat.read(md.with_suffix(".ipynb"), as_version=4)
    check = nbformat.v4.new_code_cell(
        "import jax, nnxscale\n"
        "print(jax.device_count(), jax.devices()[0].platform, nnxscale.__file__)"
    )
    notebook.cells.append(check)  # after "Run all": what did the notebook run on?
    NotebookClient(
        notebook, kernel_name="colab", timeout=600,
        resources={"metadata": {"path": str(colab["content"])}},
    ).execute()  # fmt: skip
    count, platform, location = check.outputs[0]["text"].split()
    assert (count, platform) == ("8", "cpu")
    assert str(colab["venv"]) in location  # installed by the setup cell into the throwaway venv
