"""The library's public face: a few dozen names with one spelling each, and the modules."""

from __future__ import annotations

import ast
import re
import sys
import types
from pathlib import Path

import pytest

import nnxscale as nx
from nnxscale.launch import run

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.md"))
SPELLED = re.compile(r"\bnx\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?")


def code_of(chapter: Path) -> str:
    """The chapter's code cells, one after another."""
    cells = re.findall(r"```\{code-cell\}[^\n]*\n(.*?)```", chapter.read_text(), re.S)
    return "\n".join(cells)


def test_the_face_is_a_few_dozen_names_each_defined_once() -> None:
    assert 30 <= len(nx.__all__) <= 40 and len(set(nx.__all__)) == len(nx.__all__)
    modules = {m.__name__.removeprefix("nnxscale.") for m in nx.MODULES}
    assert not modules & set(nx.__all__)
    for name in nx.__all__:
        home = getattr(nx, name)
        assert not isinstance(home, types.ModuleType), name
    found = {p.stem for p in (ROOT / "src" / "nnxscale").glob("*.py")} - {"__init__", "__main__"}
    assert modules == found  # every module is reached as nx.<module>, and only modules


def test_the_package_imports_its_names_explicitly() -> None:
    """No lazy name table: an IDE, a linter or `dir` sees every name the package gives."""
    tree = ast.parse((ROOT / "src" / "nnxscale" / "__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module != "nnxscale"
        for alias in node.names
    } - {"annotations"}
    assert imported == set(nx.__all__)


def test_importing_starts_no_backend_and_runs_without_warnings() -> None:
    """The setup cell imports nnxscale and then emulates devices: the import must leave JAX's
    backend unstarted; `python -m nnxscale` runs its programs without runpy's warning."""
    probe = (
        "import warnings; warnings.simplefilter('error')\n"
        "import nnxscale as nx\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge.backends_are_initialized()\n"
        "nx.emulate_devices(3)\n"
        "import jax; assert jax.device_count() == 3\n"
    )
    assert run([sys.executable, "-c", probe]).returncodes == [0]
    done = run([sys.executable, "-W", "error", "-m", "nnxscale", "--help"])
    assert "train" in done.text and "Warning" not in done.text


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_chapters_spell_each_name_one_way(chapter: Path) -> None:
    """A chapter writes `nx.NAME` for a name of the face and `nx.module.NAME` for the rest;
    never a face name through its module, never a name the package does not give."""
    wrong = []
    for first, second in SPELLED.findall(code_of(chapter)):
        value = getattr(nx, first, None)
        if isinstance(value, types.ModuleType):
            if second in nx.__all__ or (second and not hasattr(value, second)):
                wrong.append(f"nx.{first}.{second}")
            elif second.startswith("_"):
                wrong.append(f"nx.{first}.{second} (private)")
        elif first not in (*nx.__all__, "__all__", "__version__"):
            wrong.append(f"nx.{first}")
    assert not wrong, sorted(set(wrong))
