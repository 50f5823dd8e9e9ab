"""The derivation's second stage, moving: every collective of a step as formulas, found from a
rule set's `Placement` of the abstract model: FSDP's gathers of weights and the reductions
of their gradients, ZeRO's gather of updated parameters, tensor parallelism's all-reduces,
expert parallelism's all-to-alls, a context ring's hops and a pipeline's hand-overs
(`nnxscale.costs.derive` adds them to a step's costs)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from nnxscale.costs.arrays import Placement, per_micro_batch
from nnxscale.costs.counts import STATE_BYTES
from nnxscale.costs.formula import Formula
from nnxscale.placement.constraints import ROUTED


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


def weight_transfers(
    placement: Placement, passes: Formula, reductions: Formula, width: float
) -> list[Transfer]:
    """Gathers of weights split over the tokens' axes (FSDP), reductions of the gradients
    over those axes, and ZeRO's gather of updated parameters, from the arrays' layouts."""
    tokens = placement.tokens
    groups: dict[tuple[str, tuple[str, ...], str], Formula] = {}

    def add(kind: str, axes: Iterable[str], overlap: str, value: Formula) -> None:
        key = (kind, placement.ordered(axes), overlap)
        if key[1]:
            groups[key] = groups.get(key, Formula()) + value

    for a in placement.arrays:
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


def activation_transfers(
    placement: Placement, width: float, passes: int, moe: bool, rerun: bool
) -> list[Transfer]:
    """What moves activations between devices: tensor parallelism's all-reduces, expert
    parallelism's all-to-alls (in each of `passes`) and ring attention's hops (their forward
    again when remat rebuilds the layer: `rerun`)."""
    found = tensor_all_reduces(placement, width, passes, moe)
    if moe:
        found += expert_all_to_alls(placement, width, passes)
    return found + ring_hops(placement, width, rerun)


def tensor_all_reduces(
    placement: Placement, width: float, passes: int, moe: bool = False
) -> list[Transfer]:
    """Tensor parallelism's all-reduces of the residual stream: one per layer for each of
    attention and MLP if their weights are split, in each of `passes` (Megatron-LM's count),
    two for a vocabulary-parallel embedding and head. A mixture's experts reduce their slots
    (`moe`): the partial sums of the experts' products, before the combine."""

    def per_device(sizes: str) -> Formula:
        return per_micro_batch(placement.split(Formula.product(sizes.split(), width)))

    stream = per_device("batch seq embed")
    found = []
    for name, per_layer, what, array in (
        ("heads", True, "attention outputs", stream),
        ("mlp", True, "MLP outputs", stream),
        ("vocab", False, "embedding and head outputs", stream),
    ):
        if moe and name == "mlp":
            what, array = "experts' slots", per_device("batch experts capacity embed")
        axes = placement.tensor(name)
        if axes:
            count = Formula.of("layers") * passes if per_layer else Formula.of(2)
            found.append(
                Transfer("all-reduce", axes, array, count * "micro", count, "blocking", what)
            )
    return found


def expert_all_to_alls(placement: Placement, width: float, passes: int) -> list[Transfer]:
    """Expert parallelism's all-to-alls of the experts' slots: to the experts and back, in
    each of `passes`, over the first axis that splits the experts."""
    experts = placement.ordered(
        a
        for c in placement.rules.logical.get("experts", ())
        for a in ((c,) if isinstance(c, str) else c)
    )
    if not experts:
        return []
    slots = per_micro_batch(
        placement.split(Formula.product(["batch", "experts", "capacity", "embed"], width))
    )
    count = Formula.of("layers") * 2 * passes
    return [
        Transfer(
            "all-to-all", experts[:1], slots, count * "micro", count, "blocking",
            "experts' slots",
        )
    ]  # fmt: skip


def ring_hops(placement: Placement, width: float, rerun: bool) -> list[Transfer]:
    """Ring attention's hops when the sequence is split: keys and values in the compute
    dtype, their gradients in float32."""
    axis = placement.ring
    if axis is None:
        return []
    values = Formula.product(["batch", "seq", "kv_heads", "head_dim"], 2)  # a K and a V block
    hops = Formula.of(axis) - 1
    # forward: N-1 hops, again when remat rebuilds the layer; backward: N-1 more, the
    # first shared with the forward's (the compiler sends it once)
    keys = Formula.of("layers") * (hops * (2 if rerun else 1) + hops - 1)
    grads = Formula.of("layers") * Formula.of(axis)  # with K and V, and one hop home
    return [
        Transfer(
            "collective-permute", (axis,), per_micro_batch(placement.split(values * size)),
            count * "micro", count, "ring", what,
        )
        for size, count, what in (
            (width, keys, "keys and values"),
            (STATE_BYTES, grads, "their gradients, in float32"),
        )
    ]  # fmt: skip


HAND_OVERS = "stage inputs and their gradients"
"""What a pipeline's collective-permutes between stages move."""


def hand_overs(stage: str, array: Formula, sends: Formula) -> Transfer:
    """A pipeline's hand-overs over `stage`: `array` (one micro-batch's stage input, or its
    gradient) sent `sends` times a step, each on the critical path."""
    return Transfer("collective-permute", (stage,), array, sends, sends, "blocking", HAND_OVERS)


def in_stages(transfers: list[Transfer], stage: str) -> list[Transfer]:
    """`transfers` counted per layer of the model, counted per layer of one stage."""
    return [
        dataclasses.replace(t, passes=t.passes.per([stage]), launches=t.launches.per([stage]))
        if any("layers" in dict(powers) for powers in t.launches.terms)
        else t
        for t in transfers
    ]
