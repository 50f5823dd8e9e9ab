"""What the tests know about the book: its chapters, configuration and canonical setup cell."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import yaml

from nnxscale.runtime.launch import run

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9A-Z][0-9]_*.md"))
"""Numbered chapters (`01_...`), then appendices (`A1_...`)."""
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
REPOSITORY = CONFIG["repository"]["url"]
BRANCH = CONFIG["repository"]["branch"]


def _script(name: str) -> object:
    """The module of the book's script `book/NAME.py`."""
    spec = importlib.util.spec_from_file_location(f"book_{name}", ROOT / "book" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


colab = _script("colab")
"""book/colab.py, which writes the notebooks the Colab links open."""

KERNEL_PACKAGES = ("ipykernel",)
"""What every Jupyter and Colab runtime has besides Python: the kernel, which brings IPython.
The Colab simulation gives its kernel these and nothing else; the setup cell installs the
rest, so a chapter may import only the standard library, the kernel's packages and what
`pip install nnxscale` brings."""

SETUP_CELL = """\
# Setup: on Colab, install the book's library; everywhere, emulate devices
# before JAX starts.
import importlib.util
import os
import subprocess
import sys

if "google.colab" in sys.modules and importlib.util.find_spec("nnxscale") is None:
    source = os.environ.get(
        "NNXSCALE_SOURCE", "git+{repository}@{branch}"
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", source], check=True
    )
    importlib.invalidate_caches()

import nnxscale as nx

nx.emulate_devices()"""


def setup_cell() -> str:
    """The setup cell every chapter starts with, installing from the configured repository."""
    return SETUP_CELL.format(repository=REPOSITORY, branch=BRANCH)


def tracked(path: Path) -> bool:
    """Whether git tracks `path` (Colab opens the committed file, not the working copy)."""
    listed = ["git", "ls-files", "--error-unmatch", str(path.relative_to(ROOT))]
    return run(listed, cwd=ROOT, check=False).returncodes == [0]


def copy_checkout(destination: Path) -> Path:
    """The files a commit of this working tree would hold (tracked, or new and not ignored)."""
    listed = run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT
    ).text.split()
    for name in listed:
        if (ROOT / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, destination / name)
    return destination
