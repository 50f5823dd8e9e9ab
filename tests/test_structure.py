"""The library's shape: small modules, classes and functions, layers that import only the
layers below them, and no import cycle (`src/nnxscale`, read as source, nothing imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "src" / "nnxscale"
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 600, 200, 60
FORMAT_SKIPS = 10
LAYERS = (
    "core",
    "runtime",
    "placement",
    "model",
    "analysis",
    "train",
    "checkpoint",
    "parallelism",
    "costs",
    "evidence",
    "profiling",
    "figures",
)
"""The subpackages, each importing only from those before it (and itself); the package's
face (`__init__`) and its programs (`cli`, `__main__`) sit on top."""


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the library."""
    found = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
        found[".".join(parts).removesuffix(".__init__")] = path
    return found


def imports(path: Path) -> set[str]:
    """The library modules `path` imports, wherever in the file (a function's own imports
    too): `from nnxscale.a import b` imports nnxscale.a.b when that is a module."""
    known, found = modules(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nnxscale"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("nnxscale.")}
    return found


def layer(module: str) -> str | None:
    """The layer (subpackage) a module belongs to, or None for the face and programs."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def test_modules_classes_and_functions_are_small() -> None:
    large = []
    for name, path in modules().items():
        source = path.read_text()
        if (lines := len(source.splitlines())) > MODULE_LINES:
            large.append(f"module {name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            limit = {ast.ClassDef: CLASS_LINES, ast.FunctionDef: FUNCTION_LINES}.get(type(node))
            if limit and (lines := node.end_lineno - node.lineno + 1) > limit:
                large.append(f"{type(node).__name__} {name}.{node.name}: {lines} lines")
    assert not large, large


def test_every_module_lives_in_a_layer() -> None:
    top = {name for name in modules() if layer(name) is None}
    assert top == {"nnxscale", "nnxscale.cli", "nnxscale.__main__"}
    assert {layer(name) for name in modules()} - {None} == set(LAYERS)


@pytest.mark.parametrize("name", [n for n in modules() if layer(n)])
def test_a_layer_imports_only_the_layers_below_it(name: str) -> None:
    mine = LAYERS.index(layer(name))
    above = sorted(
        m for m in imports(modules()[name]) if LAYERS.index(layer(m) or "figures") > mine
    )
    assert not above, f"{name} imports from a layer above its own: {above}"


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles of `graph` (module -> modules it imports), each as the path around it."""
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycles.append([*path[path.index(name) :], name])
            return
        if name in done:
            return
        for other in sorted(graph.get(name, ())):
            visit(other, [*path, name])
        done.add(name)

    for name in graph:
        visit(name, [])
    return cycles


def test_no_module_imports_itself_through_others() -> None:
    assert cycles_in({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    graph = {name: imports(path) - {name} for name, path in modules().items()}
    assert not cycles_in(graph), cycles_in(graph)[:3]


def test_the_layer_rounds_and_checksums_know_no_model() -> None:
    """A pipeline of any model holds its layers in rounds; checksums read any train state."""
    for name in ("nnxscale.placement.rounds", "nnxscale.checkpoint.integrity"):
        assert not {m for m in imports(modules()[name]) if m.startswith("nnxscale.model")}


def test_formatting_is_skipped_only_where_it_helps_reading() -> None:
    skips = sum(p.read_text().count("# fmt: skip") for p in modules().values())
    assert skips <= FORMAT_SKIPS, skips
