"""The library's public face: a few dozen names with one spelling each, and the modules."""

from __future__ import annotations

import ast
import re
import sys
import types
from pathlib import Path

import pytest

import nnxscale as nx
from nnxscale.runtime.launch import run

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.md"))
SPELLED = re.compile(r"\bnx\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?")


def code_of(chapter: Path) -> str:
    """The chapter's code cells, one after another."""
    cells = re.findall(r"```\{code-cell\}[^\n]*\n(.*?)```", chapter.read_text(), re.S)
    return "\n".join(cells)


def test_the_face_is_a_few_dozen_names_each_defined_once() -> None:
    assert 30 <= len(nx.__all__) <= 40 and len(set(nx.__all__)) == len(nx.__all__)
    short = {m.__name__.rsplit(".", 1)[-1]: m for m in nx.MODULES}
    assert len(short) == len(nx.MODULES) and not short.keys() & set(nx.__all__)
    assert all(getattr(nx, name) is module for name, module in short.items())
    for name in nx.__all__:
        home = getattr(nx, name)
        assert not isinstance(home, types.ModuleType), name
    # Every file of the library is reached from the face: as nx.<module>, or inside a package
    # reached as nx.<package> (a module cut along its concepts keeps its old name's names).
    packages = {m.__name__ for m in nx.MODULES if hasattr(m, "__path__")}
    library = ROOT / "src" / "nnxscale"
    for path in library.rglob("*.py"):
        if path.stem in ("__init__", "__main__"):
            continue
        dotted = ".".join(("nnxscale", *path.relative_to(library).with_suffix("").parts))
        reached = dotted in {m.__name__ for m in nx.MODULES}
        assert reached or dotted.rsplit(".", 1)[0] in packages, dotted


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
    assert imported - {m.__name__.rsplit(".", 1)[-1] for m in nx.MODULES} == set(nx.__all__)


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
