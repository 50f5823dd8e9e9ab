"""The library's shape: small modules, classes and functions, layers that import only the
layers below them, and no import cycle (`src/nnxscale`, read as source, nothing imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "src" / "nnxscale"
MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 600, 200, 60
LARGER = {
    "class nnxscale.checkpoint.store.Checkpoints": (
        300,
        "the writer's policy and the one object a reader holds: its reads and restores are "
        "one-line delegations to its view (`Stored`) and to `restoring`'s functions",
    ),
}
"""Units allowed past their cap, each with its budget and the reason: the caps are alarms
that ask whether a unit holds one concept, not walls to split it at."""
MODEL_DOORS = {
    "nnxscale.train.trainer": (
        {"nnxscale.model.config", "nnxscale.model.transformer"},
        "trainer_for builds the book's Transformer from a Config (TINY by default)",
    ),
}
"""The one place below `model` that the training and checkpoint layers reach past the loss,
and why: every other module of `train` and `checkpoint` knows a model only by its loss."""
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
    """Under the caps, or under the budget a unit names with its reason (`LARGER`); a named
    budget that is no longer needed goes too."""
    large, sizes = [], {}
    for name, path in modules().items():
        source = path.read_text()
        sizes[f"module {name}"] = len(source.splitlines()), MODULE_LINES
        for node in ast.walk(ast.parse(source)):
            kind = {ast.ClassDef: "class", ast.FunctionDef: "function"}.get(type(node))
            if kind:
                cap = CLASS_LINES if kind == "class" else FUNCTION_LINES
                sizes[f"{kind} {name}.{node.name}"] = node.end_lineno - node.lineno + 1, cap
    for unit, (lines, cap) in sizes.items():
        limit = LARGER.get(unit, (cap, ""))[0]
        if lines > limit:
            large.append(f"{unit}: {lines} lines")
    assert not large, large
    assert all(sizes[unit][0] > sizes[unit][1] for unit in LARGER), "a budget no unit needs"


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


@pytest.mark.parametrize("name", [n for n in modules() if layer(n) in ("train", "checkpoint")])
def test_training_and_checkpoints_know_a_model_only_by_its_loss(name: str) -> None:
    """The train step is one step for every model: a model's own updates come through
    `nnxscale.steered`, its configuration through its `cfg`, never by importing it."""
    allowed = {"nnxscale.model.losses", *MODEL_DOORS.get(name, (set(),))[0]}
    reached = {m for m in imports(modules()[name]) if m.startswith("nnxscale.model")}
    assert reached <= allowed, f"{name} imports {sorted(reached - allowed)} from the model"


def test_the_architecture_names_every_layer_in_order() -> None:
    """ARCHITECTURE.md's layer map lists the layers as the import rule orders them."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    rows = [m for m in (f"| `{name}` |" for name in LAYERS) if m in text]
    assert rows == [f"| `{name}` |" for name in LAYERS]
    assert [text.index(row) for row in rows] == sorted(text.index(row) for row in rows)


DERIVATION = {
    "nnxscale.costs.arrays": "place",
    "nnxscale.costs.moves": "move",
    "nnxscale.costs.ledgers": "hold",
    "nnxscale.costs.derive": "assemble",
}
"""The cost derivation's stages, in order; moving and holding both read the placement."""
STAGE_ORDER = {"place": 0, "move": 1, "hold": 1, "assemble": 2}


def backward(name: str, reached: set[str]) -> list[str]:
    """The stages `name` imports that are not before its own."""
    rank = STAGE_ORDER[DERIVATION[name]]
    return sorted(
        m for m in reached & DERIVATION.keys() if m != name and STAGE_ORDER[DERIVATION[m]] >= rank
    )


def test_a_stage_calling_back_is_found() -> None:
    assert backward("nnxscale.costs.arrays", {"nnxscale.costs.moves"}) == ["nnxscale.costs.moves"]
    assert backward("nnxscale.costs.moves", {"nnxscale.costs.ledgers"}) == [
        "nnxscale.costs.ledgers"
    ]
    assert backward("nnxscale.costs.derive", set(DERIVATION)) == []


@pytest.mark.parametrize("name", list(DERIVATION))
def test_each_stage_of_the_cost_derivation_reads_only_the_stages_before_it(name: str) -> None:
    """Place, then move and hold (side by side), then assemble: no stage imports a later
    one or its sibling, so none calls back into another."""
    assert not backward(name, imports(modules()[name]))
