"""What moves activations between devices in a step, as formulas: tensor parallelism's
all-reduces, expert parallelism's all-to-alls and a context ring's hops, found from the
layout a rule set gives the abstract model (`nnxscale.costs.derive` adds them to a step's
costs)."""

from __future__ import annotations

from nnxscale.costs.arrays import (
    PlacedArray,
    Transfer,
    ordered,
    per_micro_batch,
    split_by,
    tensor_axes,
)
from nnxscale.costs.counts import STATE_BYTES
from nnxscale.costs.formula import Formula
from nnxscale.placement.rules import Rules


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


def activation_transfers(
    arrays: list[PlacedArray], rules: Rules, width: float, passes: int, moe: bool, rerun: bool
) -> list[Transfer]:
    """What moves activations between devices: tensor parallelism's all-reduces, expert
    parallelism's all-to-alls (in each of `passes`) and ring attention's hops (their forward
    again when remat rebuilds the layer: `rerun`)."""
    found = tensor_all_reduces(arrays, rules, width, passes, moe)
    if moe:
        found += expert_all_to_alls(rules, width, passes)
    return found + ring_hops(rules, width, rerun)


def tensor_all_reduces(
    arrays: list[PlacedArray], rules: Rules, width: float, passes: int, moe: bool = False
) -> list[Transfer]:
    """Tensor parallelism's all-reduces of the residual stream: one per layer for each of
    attention and MLP if their weights are split, in each of `passes` (Megatron-LM's count),
    two for a vocabulary-parallel embedding and head. A mixture's experts reduce their slots
    (`moe`): the partial sums of the experts' products, before the combine."""

    def per_device(sizes: str) -> Formula:
        return per_micro_batch(split_by(Formula.product(sizes.split(), width), rules))

    stream = per_device("batch seq embed")
    found = []
    for name, per_layer, what, array in (
        ("heads", True, "attention outputs", stream),
        ("mlp", True, "MLP outputs", stream),
        ("vocab", False, "embedding and head outputs", stream),
    ):
        if moe and name == "mlp":
            what, array = "experts' slots", per_device("batch experts capacity embed")
        axes = tensor_axes(arrays, name, rules)
        if axes:
            count = Formula.of("layers") * passes if per_layer else Formula.of(2)
            found.append(
                Transfer("all-reduce", axes, array, count * "micro", count, "blocking", what)
            )
    return found


def expert_all_to_alls(rules: Rules, width: float, passes: int) -> list[Transfer]:
    """Expert parallelism's all-to-alls of the experts' slots: to the experts and back, in
    each of `passes`, over the first axis that splits the experts."""
    experts = ordered(
        (a for c in rules.logical.get("experts", ()) for a in ((c,) if isinstance(c, str) else c)),
        rules,
    )
    if not experts:
        return []
    slots = per_micro_batch(
        split_by(Formula.product(["batch", "experts", "capacity", "embed"], width), rules)
    )
    count = Formula.of("layers") * 2 * passes
    return [
        Transfer(
            "all-to-all", experts[:1], slots, count * "micro", count, "blocking",
            "experts' slots",
        )
    ]  # fmt: skip


def ring_hops(rules: Rules, width: float, rerun: bool) -> list[Transfer]:
    """Ring attention's hops when the sequence is split: keys and values in the compute
    dtype, their gradients in float32."""
    axis = context_axis(rules)
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
            "collective-permute", (axis,), per_micro_batch(split_by(values * size, rules)),
            count * "micro", count, "ring", what,
        )
        for size, count, what in (
            (width, keys, "keys and values"),
            (STATE_BYTES, grads, "their gradients, in float32"),
        )
    ]  # fmt: skip
