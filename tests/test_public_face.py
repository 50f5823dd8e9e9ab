"""The library's public face: a few dozen names with one spelling each, and the modules.

One spelling per public name: `nx.NAME` for the face's names (`nx.__all__`), `nx.module.NAME`
for every other one, where `nx.module` is the one namespace that offers it (a module of
`nx.MODULES`; the packages `nx.costs`, `nx.checkpoint`, ... offer their `__all__`, a leaf
module the names it defines). Chapters, Colab notebooks, tests, benchmarks and the book's
scripts are read for every `nx.` spelling and every `from nnxscale... import`, and a second
path to a name fails here."""

from __future__ import annotations

import ast
import collections
import contextlib
import json
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import nnxscale as nx
from nnxscale.runtime.launch import run

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.md"))
COLAB = sorted((ROOT / "colab").glob("*.ipynb"))
SCRIPTS = sorted(p for d in ("tests", "benchmarks", "book") for p in (ROOT / d).rglob("*.py"))
SHORT = {m.__name__.rsplit(".", 1)[-1]: m for m in nx.MODULES}
FACE_EXTRAS = {"MODULES", "__all__", "__version__"}


def defined_in(module: types.ModuleType) -> set[str]:
    """The public names a module's own source binds at its top level (not those it imports)."""
    names = set()
    for node in ast.parse(Path(module.__file__).read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                targets = target.elts if isinstance(target, ast.Tuple) else [target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")}


FACE = {id(getattr(nx, name)) for name in nx.__all__}


def offered(module: types.ModuleType) -> set[str]:
    """The names a namespace of the face offers: a package its `__all__`, a leaf module what
    it defines; never a name of the face itself (`nx.FSDP`, not `nx.catalogue.FSDP`)."""
    if module is nx:
        return set(nx.__all__) | set(SHORT) | FACE_EXTRAS
    names = set(module.__all__) if hasattr(module, "__path__") else defined_in(module)
    return {n for n in names if id(getattr(module, n)) not in FACE}


def homes() -> dict[str, str]:
    """Every public name's defining module, by the name: where `from ... import` may take it."""
    found = collections.defaultdict(set)
    for path in (ROOT / "src" / "nnxscale").rglob("*.py"):
        dotted = ".".join(("nnxscale", *path.relative_to(ROOT / "src" / "nnxscale").parts))
        dotted = dotted.removesuffix(".py").removesuffix(".__init__")
        for name in defined_in(types.SimpleNamespace(__file__=str(path))):
            found[name].add(dotted)
    return found


def spellings() -> dict[int, list[str]]:
    """id of each public object -> the spellings that reach it. Numbers and strings are left
    out: equal small values are one object in CPython, so their identity means nothing."""
    found = collections.defaultdict(list)
    for name in nx.__all__:
        found[id(getattr(nx, name))].append(f"nx.{name}")
    for short, module in SHORT.items():
        for name in offered(module):
            value = getattr(module, name)
            if not isinstance(value, types.ModuleType | int | float | str | None):
                found[id(value)].append(f"nx.{short}.{name}")
    return found


def test_the_face_is_a_few_dozen_names_each_defined_once() -> None:
    assert 30 <= len(nx.__all__) <= 40 and len(set(nx.__all__)) == len(nx.__all__)
    assert len(SHORT) == len(nx.MODULES) and not SHORT.keys() & set(nx.__all__)
    assert all(getattr(nx, name) is module for name, module in SHORT.items())
    for name in nx.__all__:
        assert not isinstance(getattr(nx, name), types.ModuleType), name
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


def test_every_public_name_has_one_spelling() -> None:
    twice = sorted(s for s in spellings().values() if len(s) > 1)
    assert not twice, twice


def test_a_package_offers_only_its_own_layers_names() -> None:
    """`nx.train` offers the trainer's names, not the devices' `FAST_COMPILE` nor the model's
    loss: each is spelled where it lives."""
    for module in nx.MODULES:
        if hasattr(module, "__path__"):
            outside = {
                name
                for name in module.__all__
                if isinstance(getattr(module, name), type | types.FunctionType)
                and not getattr(module, name).__module__.startswith(module.__name__)
            }
            assert not outside, (module.__name__, sorted(outside))


def test_no_two_public_classes_share_a_name() -> None:
    """A class is known by its name in errors, reprs and the docs: `costs.PricedCollective` is
    the cost model's, `hlo.Collective` the compiled program's."""
    classes = collections.defaultdict(set)
    for module in SHORT.values():
        for name in offered(module):
            if isinstance(value := getattr(module, name), type):
                classes[name].add(f"{value.__module__}.{value.__qualname__}")
    for name in nx.__all__:
        if isinstance(value := getattr(nx, name), type):
            classes[name].add(f"{value.__module__}.{value.__qualname__}")
    assert not {name: homes for name, homes in classes.items() if len(homes) > 1}


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
    assert imported - set(SHORT) == set(nx.__all__)


def test_importing_starts_no_backend_and_runs_without_warnings() -> None:
    """The setup cell imports nnxscale and then emulates devices: the import must leave JAX's
    backend unstarted, and matplotlib unimported until a figure draws; `python -m nnxscale`
    runs its programs without runpy's warning."""
    probe = (
        "import warnings; warnings.simplefilter('error')\n"
        "import nnxscale as nx\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge.backends_are_initialized()\n"
        "import sys; assert 'matplotlib' not in sys.modules  # imported when a figure draws\n"
        "nx.emulate_devices(3)\n"
        "import jax; assert jax.device_count() == 3\n"
    )
    assert run([sys.executable, "-c", probe]).returncodes == [0]
    done = run([sys.executable, "-W", "error", "-m", "nnxscale", "--help"])
    assert "train" in done.text and "Warning" not in done.text


def code_of(path: Path) -> str:
    """The Python a file holds: a chapter's or notebook's code cells, a script whole; the
    cells' shell and magic lines left out."""
    if path.suffix == ".py":
        return path.read_text()
    if path.suffix == ".md":
        cells = re.findall(r"```\{code-cell\}[^\n]*\n(.*?)```", path.read_text(), re.S)
    else:
        notebook = json.loads(path.read_text())
        cells = ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
    cells = [re.sub(r"\A---\n.*?\n---\n|\A(:\w+:[^\n]*\n)+", "", c, flags=re.S) for c in cells]
    lines = [ln for c in cells for ln in c.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    return "\n".join(lines)


def misspelled(source: str) -> Iterator[str]:
    """Every spelling in `source` that is not a name's one spelling: `nx.a.b` and `m.b` (for
    `m` imported from nnxscale) that the namespace does not offer, and `from nnxscale.x import
    y` where `x` is neither the namespace that offers `y` nor the module that defines it."""
    names, found = homes(), {}
    tree = ast.parse(source)
    for node in ast.walk(tree):  # the programs a test or chapter writes out and runs
        text = node.value if isinstance(node, ast.Constant) else None
        if isinstance(text, str) and "nnxscale" in text and "\n" in text:
            with contextlib.suppress(SyntaxError):
                yield from misspelled(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.asname: nx for a in node.names if a.name == "nnxscale" and a.asname}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nnxscale"):
            for alias in node.names:
                if alias.name in SHORT and node.module == "nnxscale":
                    found[alias.asname or alias.name] = SHORT[alias.name]
                elif alias.name in nx.__all__ and node.module != "nnxscale":
                    if node.module not in names[alias.name]:
                        yield f"from {node.module} import {alias.name} (nx.{alias.name})"
                elif node.module in (m.__name__ for m in SHORT.values()):
                    module = sys.modules[node.module]
                    if (
                        alias.name not in offered(module)
                        and node.module not in names[alias.name]
                        and not isinstance(getattr(module, alias.name, None), types.ModuleType)
                    ):
                        yield f"from {node.module} import {alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            base = found.get(node.value.id)
            if (
                base is not None
                and not node.attr.startswith("_")
                and node.attr not in offered(base)
            ):
                yield f"{node.value.id}.{node.attr}"
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and found.get(node.value.value.id) is nx
            and node.value.attr in SHORT
            and node.attr not in offered(SHORT[node.value.attr])
        ):
            yield f"{node.value.value.id}.{node.value.attr}.{node.attr}"


def test_a_second_path_is_found() -> None:
    wrong = (
        "import nnxscale as nx\nfrom nnxscale import costs\nfrom nnxscale.train import Trainer\n"
        "from nnxscale.train import next_token_loss\n"
        "nx.train.FAST_COMPILE, nx.rules.FSDP, costs.SEVEN_B, nx.fsdp.Rules, nx.Trainer\n"
    )
    assert sorted(set(misspelled(wrong))) == [
        "costs.SEVEN_B",
        "from nnxscale.train import Trainer (nx.Trainer)",
        "from nnxscale.train import next_token_loss",
        "nx.fsdp.Rules",
        "nx.rules.FSDP",
        "nx.train.FAST_COMPILE",
    ]


@pytest.mark.parametrize(
    "path",
    [*CHAPTERS, *COLAB, *(p for p in SCRIPTS if p != Path(__file__))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_name_is_spelled_one_way(path: Path) -> None:
    """Chapters, Colab notebooks, tests, benchmarks and the book's scripts write each name the
    one way the face offers it."""
    assert not sorted(set(misspelled(code_of(path))))
