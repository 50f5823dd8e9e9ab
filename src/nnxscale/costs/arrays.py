"""The derivation's first stage, placing: each array of the abstract model placed by a rule set
on a mesh of size-1 axes (which mesh axes split which dimension), and the facts every later
stage reads off that layout (`Placement`): the axes that split the tokens, a context ring's
axis, a pipeline's stage axis, the tensor-parallel axes of each product, and how an array
of any shape is split as an activation or as a weight's read copy.

The stages run one way: place (here); then move (`nnxscale.costs.moves`: the collectives)
and hold (`nnxscale.costs.ledgers`: the bytes each device keeps), each reading a
`Placement`; then assemble (`nnxscale.costs.derive`: one `Costs` per rule set). No stage
calls a later one."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable

from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from nnxscale.costs.activations import EXPERTS, LOGICAL, PRIMES, factor
from nnxscale.costs.counts import SIZES, STATE_BYTES
from nnxscale.costs.formula import Formula
from nnxscale.model.casting import CAST_WEIGHTS
from nnxscale.model.config import Config
from nnxscale.model.transformer import create
from nnxscale.placement.constraints import ROUTED, activation_axes, weight_axes
from nnxscale.placement.init import abstract
from nnxscale.placement.layout import resolve
from nnxscale.placement.rules import RuleError, Rules


def _unit_mesh(rules: Rules) -> AbstractMesh:
    """The rule set's mesh with every axis of size 1: where only the structure of a layout
    shows (which axes split which dimension), not whether sizes divide."""
    return AbstractMesh(
        (1,) * len(rules.axes), rules.axes, axis_types=(AxisType.Auto,) * len(rules.axes)
    )


PARAMETER_PRIMES = {
    **{k: v for k, v in PRIMES.items() if k not in ("batch", "seq")},
    "experts": EXPERTS,
}
"""The sizes of the abstract model the layouts are read off (`max_len` is `PRIMES["seq"]`)."""


@functools.cache
def _parameters(moe: bool) -> nnx.State:
    """The abstract parameters of the book's Transformer with stacked layers (shapes only),
    dense or with a mixture of experts."""
    sizes = {k: v for k, v in PARAMETER_PRIMES.items() if k != "experts"}
    experts = EXPERTS if moe else 0
    cfg = Config(**sizes, max_len=PRIMES["seq"], scan_layers=True, experts=experts)
    return nnx.state(abstract(lambda: create(cfg)), nnx.Param)


def _dimension(name: str | None, size: int) -> str:
    """The size name of a parameter's dimension: its logical name's, or for a dimension
    without one (the router's experts) the traced size it is."""
    if name is not None:
        return name
    (found,) = factor(size, PARAMETER_PRIMES).elements()
    return found


@dataclasses.dataclass(frozen=True)
class PlacedArray:
    """One parameter as the cost model sees it: path, logical names, elements, whether the
    model reads it through a compute-dtype copy, and the axes splitting each dimension by role."""

    path: str
    names: tuple[str, ...]
    elements: Formula
    cast: bool
    axes: dict[str, tuple[tuple[str, ...], ...]]

    def per_device(self, role: str, itemsize: float = STATE_BYTES) -> Formula:
        """Bytes one device holds of it in the layout of `role`."""
        return (self.elements * itemsize).per(a for axes in self.axes[role] for a in axes)


@dataclasses.dataclass(frozen=True)
class Placement:
    """A rule set's layout of the abstract model, dense or with a mixture of experts
    (`placed`), and the facts the later stages read off it, each found once."""

    rules: Rules
    arrays: tuple[PlacedArray, ...]
    tokens: frozenset[str]
    """The mesh axes that split the tokens (`Rules.token_axes`): gradients are summed over
    them, and weights split over them are gathered."""
    ring: str | None
    """The axis, other than the batch's, that splits the sequence (a context ring)."""
    stage: str | None
    """The axis that splits the stacked layers (a pipeline's stages)."""

    def split(
        self, formula: Formula, *, weights: bool = False, sequence: str = "length"
    ) -> Formula:
        """`formula` (bytes of whole arrays, one term per kind of array) as one device holds
        it: each term divided by the sizes of the mesh axes the rule set splits its
        dimensions over, as an activation (its `seq` placed as the logical axis `sequence`),
        or as the read copy of a weight (`weight_axes`). A term names each dimension once,
        so an array that repeats an axis across two of them (a mixture's slots, split by
        group and by expert) is split once, not refused as a strict rule set would."""
        rules = dataclasses.replace(self.rules, strict=False)
        mesh, out = _unit_mesh(rules), Formula()
        logical = {**LOGICAL, "seq": sequence}
        for powers, coefficient in formula.terms.items():
            names = _order([logical.get(n, n) for n, p in powers for _ in range(p)])
            shape = (1,) * len(names)
            if weights:
                axes = weight_axes(shape, names, rules, mesh)[1]
            else:
                axes = activation_axes(shape, names, rules, mesh)
            out += Formula({powers: coefficient}).per(a for dim in axes if dim for a in dim)
        return out

    def split_kept(self, formula: Formula, stream: Formula) -> Formula:
        """`split` for activations of which `stream` lies on the residual stream: that part
        split along the sequence as `residual_length` (Megatron's sequence parallelism), the
        rest as `length`."""
        return self.split(formula - stream) + self.split(stream, sequence="residual_length")

    def local(self, formula: Formula) -> Formula:
        """A ring's kept blocks, already per device along the sequence (in `chunk`), split
        over the other axes as activations are, with `chunk` as `seq / context`."""
        return (
            self.split(formula)
            .replace("chunk", {"seq": 1, self.ring: -1})
            .replace("context", {self.ring: 1})
        )

    def ordered(self, axes: Iterable[str]) -> tuple[str, ...]:
        """`axes` in the rule set's mesh order."""
        found = set(axes)
        return tuple(a for a in self.rules.axes if a in found)

    def tensor(self, name: str) -> tuple[str, ...]:
        """The mesh axes, other than the tokens', that split dimension `name` of the
        weights: the axes over which the products that contract it are tensor-parallel."""
        for array in self.arrays:
            for dim, axes in zip(array.names, array.axes["params"], strict=True):
                if dim == name and axes and name in ("heads", "mlp", "vocab"):
                    return self.ordered(a for a in axes if a not in self.tokens)
        return ()

    def stored_over_tokens(self, array: PlacedArray) -> bool:
        """Whether the tokens' axes split any dimension of `array`'s stored parameter."""
        return bool(self.tokens & {x for d in array.axes["params"] for x in d})

    def gathered(self, array: PlacedArray) -> Formula:
        """The elements of `array` one device reads once FSDP gathers it over the tokens'
        axes: split only by the other axes, a mixture's experts still by their own."""
        return array.elements.per(
            x
            for name, d in zip(array.names, array.axes["params"], strict=True)
            for x in d
            if name in ROUTED or x not in self.tokens
        )


_PLACED: dict[tuple[str, bool], Placement] = {}


def placed(rules: Rules, moe: bool) -> Placement:
    """Every parameter of the model with its axes under `rules`, for each role, and what the
    later stages read off that layout (found once per rule set and MLP)."""
    key = (rules.key, moe)
    if key not in _PLACED:
        arrays = tuple(_resolved_arrays(rules, moe))
        tokens = frozenset(rules.token_axes(rules.axes))
        _PLACED[key] = Placement(rules, arrays, tokens, context_axis(rules), _stage_axis(arrays))
    return _PLACED[key]


def context_axis(rules: Rules) -> str | None:
    """The mesh axis, other than the batch's, that `rules` split the sequence over (a ring)."""
    batch = set(rules.token_axes(())) | {
        a for c in rules.logical.get("batch", ()) for a in ((c,) if isinstance(c, str) else c)
    }
    for candidate in rules.logical.get("length", ()):
        for axis in (candidate,) if isinstance(candidate, str) else candidate:
            if axis not in batch:
                return axis
    return None


def _stage_axis(arrays: Iterable[PlacedArray]) -> str | None:
    """The mesh axis that splits the stacked layers (a pipeline's stages), if any."""
    for a in arrays:
        for name, axes in zip(a.names, a.axes["params"], strict=True):
            if name == "layers" and axes:
                return axes[0]
    return None


def _resolved_arrays(rules: Rules, moe: bool) -> list[PlacedArray]:
    if rules.auto_axis is not None:
        raise RuleError(
            f"rule set {rules.name!r} splits arrays by their sizes (automatic FSDP): the cost "
            "model derives layouts from logical names alone. Resolve it at the real sizes "
            "instead (nnxscale.resolve on an AbstractMesh)."
        )
    params, mesh = _parameters(moe), _unit_mesh(rules)
    layouts = {
        role: resolve(params, rules, mesh, role=role, warn_bytes=math.inf)
        for role in ("params", "grads", "optimizer")
    }
    found = []
    for i, placement in enumerate(layouts["params"].placements):
        names = tuple(
            _dimension(n, size)
            for n, size in zip(
                placement.logical or (None,) * len(placement.shape), placement.shape, strict=True
            )
        )
        axes = {}
        for role, layout in layouts.items():
            spec = layout.placements[i].spec
            entries = tuple(spec) + (None,) * (len(names) - len(spec))
            axes[role] = tuple(
                () if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries
            )
        cast = placement.path.split("/")[-1] in CAST_WEIGHTS
        elements = Formula.product(SIZES[n] for n in names)
        found.append(PlacedArray(placement.path, names, elements, cast, axes))
    return found


def _order(names: list[str]) -> tuple[str, ...]:
    """Logical names in the order an array of them is placed: batch, then sequence, the rest."""
    rank = {"batch": 0, "length": 1, "residual_length": 1}
    return tuple(sorted(names, key=lambda n: rank.get(n, 2)))


def per_micro_batch(formula: Formula) -> Formula:
    """`formula` in `batch` (sequences per step) for one of `micro` micro-batches."""
    out = Formula()
    for powers, coefficient in formula.terms.items():
        term = Formula({powers: coefficient})
        out += term / "micro" if "batch" in dict(powers) else term
    return out
