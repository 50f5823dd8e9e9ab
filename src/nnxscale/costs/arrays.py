"""Each array of the abstract model placed by a rule set on a mesh of size-1 axes: which mesh
axes split which dimension, and the weights a step gathers, as formulas."""

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
from nnxscale.model.transformer import Config, create
from nnxscale.placement.constraints import ROUTED, activation_axes, weight_axes
from nnxscale.placement.init import abstract
from nnxscale.placement.layout import resolve
from nnxscale.placement.rules import RuleError, Rules


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One group of collectives of a step, as formulas: of `kind` over mesh `axes`, the bytes
    of the arrays one pass moves (the P of the ring formulas, summed), how many passes a step
    makes, how many collectives a pass launches, and what compute it may hide behind
    (`OVERLAPS`). `what` says what it moves."""

    kind: str
    axes: tuple[str, ...]
    array: Formula
    passes: Formula
    launches: Formula
    overlap: str
    what: str

    def json(self) -> dict[str, object]:
        """As JSON, for the calculator."""
        return {
            "kind": self.kind,
            "axes": list(self.axes),
            "array": self.array.json(),
            "passes": self.passes.json(),
            "launches": self.launches.json(),
            "overlap": self.overlap,
            "what": self.what,
        }


OVERLAPS = {
    "gather": "FSDP's weight gathers: prefetched, each behind the previous layer's compute",
    "reduce": "gradient reductions: each layer's behind the backward pass of the layers below",
    "update": "ZeRO's gather of updated parameters: at the step's end, with nothing left to "
    "hide behind (one compiled step cannot prefetch into the next)",
    "ring": "ring attention's key/value hops: each behind the attention of the block in hand",
    "blocking": "on the critical path: the next product needs the result (TP's all-reduces, "
    "unless a collective matmul splits them; pipeline hops)",
}
"""What each class of collective can hide behind, given the step's dependencies."""


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


_ARRAYS: dict[tuple[str, bool], list[PlacedArray]] = {}


def arrays_of(rules: Rules, moe: bool) -> list[PlacedArray]:
    """Every parameter of the model with its axes under `rules`, for each role (resolved once
    per rule set)."""
    key = (rules.key, moe)
    if key not in _ARRAYS:
        _ARRAYS[key] = _resolved_arrays(rules, moe)
    return _ARRAYS[key]


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


def split_by(
    formula: Formula, rules: Rules, *, weights: bool = False, sequence: str = "length"
) -> Formula:
    """`formula` (bytes of whole arrays, one term per kind of array) as one device holds it:
    each term divided by the sizes of the mesh axes that `rules` split its dimensions over,
    as an activation (its `seq` placed as the logical axis `sequence`), or as the read copy
    of a weight (`weight_axes`). A term names each dimension once, so an array that repeats
    an axis across two of them (a mixture's slots, split by group and by expert) is split
    once, not refused as a strict rule set would."""
    mesh, out = _unit_mesh(rules), Formula()
    rules = dataclasses.replace(rules, strict=False)
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


def split_kept(formula: Formula, stream: Formula, rules: Rules) -> Formula:
    """`split_by` for activations of which `stream` lies on the residual stream: that part
    split along the sequence as `residual_length` (Megatron's sequence parallelism), the
    rest as `length`."""
    return split_by(formula - stream, rules) + split_by(stream, rules, sequence="residual_length")


def per_micro_batch(formula: Formula) -> Formula:
    """`formula` in `batch` (sequences per step) for one of `micro` micro-batches."""
    out = Formula()
    for powers, coefficient in formula.terms.items():
        term = Formula({powers: coefficient})
        out += term / "micro" if "batch" in dict(powers) else term
    return out


def ordered(axes: Iterable[str], rules: Rules) -> tuple[str, ...]:
    found = set(axes)
    return tuple(a for a in rules.axes if a in found)


def tensor_axes(arrays: list[PlacedArray], name: str, rules: Rules) -> tuple[str, ...]:
    """The mesh axes, other than the tokens', that split dimension `name` of the weights: the
    axes over which the products that contract it are tensor-parallel."""
    tokens = set(rules.token_axes(rules.axes))
    for array in arrays:
        for dim, axes in zip(array.names, array.axes["params"], strict=True):
            if dim == name and axes and name in ("heads", "mlp", "vocab"):
                return ordered((a for a in axes if a not in tokens), rules)
    return ()


def weight_transfers(
    arrays: list[PlacedArray], rules: Rules, passes: Formula, reductions: Formula, width: float
) -> list[Transfer]:
    """Gathers of weights split over the tokens' axes (FSDP), reductions of the gradients
    over those axes, and ZeRO's gather of updated parameters, from the arrays' layouts."""
    tokens = set(rules.token_axes(rules.axes))
    groups: dict[tuple[str, tuple[str, ...], str], Formula] = {}

    def add(kind: str, axes: Iterable[str], overlap: str, value: Formula) -> None:
        key = (kind, ordered(axes, rules), overlap)
        if key[1]:
            groups[key] = groups.get(key, Formula()) + value

    for a in arrays:
        stored = [set(x) for x in a.axes["params"]]
        routed = [n in ROUTED for n in a.names]
        gathered = {x for dim, r in zip(stored, routed, strict=True) if not r for x in dim & tokens}
        read = [dim if r else dim - tokens for dim, r in zip(stored, routed, strict=True)]
        itemsize = width if a.cast else STATE_BYTES
        local = a.elements.per(x for dim in read for x in dim)
        add("all-gather", gathered, "gather", local * itemsize)
        summed = tokens - {x for dim, r in zip(stored, routed, strict=True) if r for x in dim}
        scattered = summed & {x for dim in a.axes["optimizer"] for x in dim}
        add("reduce-scatter", scattered, "reduce", local * STATE_BYTES)
        add("all-reduce", summed - scattered, "reduce", (local * STATE_BYTES).per(scattered))
        updated = {x for dim in a.axes["optimizer"] for x in dim} - {
            x for dim in stored for x in dim
        }
        held = a.elements.per(x for dim in stored for x in dim)
        add("all-gather", updated & tokens, "update", held * STATE_BYTES)
    return [
        Transfer(
            kind,
            axes,
            array,
            passes if overlap == "gather" else reductions if overlap == "reduce" else Formula.of(1),
            Formula.of("layers"),
            overlap,
            {"gather": "weights", "reduce": "gradients", "update": "updated parameters"}[overlap],
        )
        for (kind, axes, overlap), array in groups.items()
    ]
