"""The cost model: what one training step holds, computes and sends on each device, and how
long it takes.

A strategy is a rule set and the size of each of its mesh axes (`Setup`). Everything the cost
model says about it is derived from that rule set: the rule set is resolved against the
abstract model on a mesh of size-1 axes (`jax.sharding.AbstractMesh`, no devices), which
says which mesh axes split each dimension of each array; bytes per device, the weights a
step gathers, the gradients it reduces and the activations it splits follow as `Formula`s in
the model's sizes and the axes' sizes (`derive`). The activations are those JAX's autodiff
keeps for the book's Transformer (`nnxscale.activations`), dense or with a mixture of experts
in place of each MLP. The formulas are evaluated for any model, cluster and batch
(`step_cost`), searched by the planner (`nnxscale.planner`), and written into the page for the
calculator (`nnxscale.calculator`), which only evaluates them.

This module is the derivation's last stage, assembling: it places the rule set once
(`nnxscale.costs.arrays.placed`), asks the moving stage (`nnxscale.costs.moves`) for the
collectives and the holding stage (`nnxscale.costs.ledgers`) for the bytes, adds the FLOPs,
and writes one `Costs` per schedule: lockstep, a pipeline on the book's executor, or 1F1B.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from nnxscale.costs.activations import DROPLESS, kept
from nnxscale.costs.arrays import Placement, per_micro_batch, placed
from nnxscale.costs.counts import (
    DTYPE_BYTES,
    LOGIT_BYTES,
    ROUTING,
    STATE_BYTES,
    check_ledger,
    product_flops,
    products,
)
from nnxscale.costs.coverage import unpriced
from nnxscale.costs.formula import Formula
from nnxscale.costs.ledgers import (
    fused,
    gathered_experts,
    held,
    kept_on_device,
    stage_whole,
)
from nnxscale.costs.moves import (
    Transfer,
    activation_transfers,
    hand_overs,
    in_stages,
    tensor_all_reduces,
    weight_transfers,
)
from nnxscale.model.config import remat_policy
from nnxscale.placement.rules import Rules


@dataclasses.dataclass(frozen=True)
class Costs:
    """The formulas of one rule set on the book's Transformer (`derive`): bytes per device of
    each part of the state and of the step's working memory, matmul FLOPs per device, the
    collectives, and the divisibility each split needs."""

    rules: Rules
    state: dict[str, Formula]
    activations: Formula
    weights: Formula
    rebuilt: Formula
    """What one layer holds again while its backward pass runs: with remat its activations
    rebuilt, the attention kernel's working set (`WORKSPACE`) and the MLP's gradients
    (`mlp_gradients`)."""
    gradients: Formula
    layer_gradients: Formula
    """One layer's gradients as its backward pass makes them, before any reduction."""
    head_gradients: Formula
    """The output head's gradients, the first the backward pass makes."""
    accumulator: Formula
    head: Formula
    transfers: tuple[Transfer, ...]
    flops: Formula
    splits: tuple[tuple[str, tuple[str, ...]], ...]
    """(size, mesh axes) pairs: each size must be a multiple of the product of the axes."""
    stage_axis: str | None
    """The axis that splits the layers into a pipeline's stages, if any."""
    batch_axes: tuple[str, ...] = ()
    """The axes that split the batch's sequences."""
    ring_axis: str | None = None
    """The axis that splits every sequence into a ring attention's chunks, if any."""
    forward_flops: Formula = dataclasses.field(default_factory=Formula)
    """Matmul FLOPs of the forward pass per device (what FSDP's first gathers and ZeRO's
    gather of updated parameters hide behind)."""
    attention_flops: Formula = dataclasses.field(default_factory=Formula)
    """Matmul FLOPs of attention's two products per device (what a ring's hops hide behind)."""
    schedule: str = "lockstep"
    """A pipeline's schedule (`nnxscale.costs.SCHEDULES`): what its memory and bubble are."""
    in_place: bool = False
    """Whether the optimizer updates in place from one gradient buffer that also sums the
    micro-batches (a framework's fused AdamW, the fused ledger), rather than the compiled
    step's gradient, running sum and update side by side."""
    last_stage: Formula = dataclasses.field(default_factory=Formula)
    """On a pipeline of one program per stage, what the last stage keeps when its backward
    pass starts: its layers' values for one micro-batch, the logits and the loss (the first
    stage keeps the most micro-batches in flight, `activations`, and no logits)."""

    def json(self) -> dict[str, object]:
        """Every formula and axis as JSON: what the calculator evaluates."""
        out: dict[str, object] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("rules", "state", "transfers", "splits")
        }
        out = {k: v.json() if isinstance(v, Formula) else v for k, v in out.items()}
        out["state"] = {k: v.json() for k, v in self.state.items()}
        out["transfers"] = [t.json() for t in self.transfers]
        out["splits"] = [[size, list(axes)] for size, axes in self.splits]
        out["batch_axes"] = list(self.batch_axes)
        out["in_place"] = self.in_place
        return out


_DERIVED: dict[tuple[str, str, object, int, str, bool, str, str, bool], Costs] = {}
_BASES: dict[tuple[str, str, object, int, str], Costs] = {}


def derive(
    rules: Rules,
    compute_dtype: str = "float32",
    remat: bool | str = False,
    moe: int = 0,
    schedule: str = "lockstep",
    reduce_once: bool = False,
    ledger: str = "program",
    loss: str = "fused",
    regather: bool = True,
) -> Costs:
    """The formulas of one training step of the book's Transformer under `rules`, in the
    model's sizes, `batch` (sequences per step), `seq`, `micro` (micro-batches) and the size
    of each mesh axis: derived from the layout `rules` give the abstract model (once per
    rule set, dtype, remat policy and MLP: dense, or a mixture of experts as
    `nnxscale.activations.mixture` says, whose formulas also use `experts`, `top_k` and
    `capacity`). A pipeline's formulas are those of its `schedule`; with `reduce_once`,
    those of gradient accumulation that reduces once per step (`Setup.reduce_once`). The
    memory is `ledger`'s (`nnxscale.costs.ledgers`: this library's program, or a trainer
    with fused kernels, whose `loss` holds the logits as `nnxscale.costs.LOSSES` says and
    whose products gather their inputs again under sequence parallelism, or not:
    `regather`)."""
    why = unpriced(rules, moe, schedule) or unledgered(rules, schedule, check_ledger(ledger))
    if why:
        raise ValueError(why)
    if ledger == "program":  # the program traces its own loss and gathers
        loss, regather = "fused", True
    policy = remat_policy(remat)
    base = (rules.key, compute_dtype, policy, moe, schedule)
    key = (*base, reduce_once, ledger, loss, regather)
    if key not in _DERIVED:
        if base not in _BASES:  # the program's formulas, which every ledger starts from
            _BASES[base] = _derive(rules, compute_dtype, remat, moe, schedule)
        costs = _BASES[base]
        placement = placed(rules, bool(moe))
        if ledger == "fused":
            costs = fused(costs, placement, compute_dtype, policy, moe, (loss, regather))
        _DERIVED[key] = _reduced_once(costs, placement, ledger) if reduce_once else costs
    return _DERIVED[key]


def unledgered(rules: Rules, schedule: str, ledger: str) -> str:
    """Why `ledger` has no formulas for a pipeline on `schedule`, or "": the fused ledger
    prices the schedules frameworks run, one program per stage."""
    if ledger == "fused" and rules.axes_of("layers") and schedule == "lockstep":
        return (
            "the fused ledger prices pipelines as frameworks run them, one program per stage "
            "(schedule='1F1B', 'ZB-H1' or 'ZB-V'); the lockstep executor is this library's "
            "program: ledger='program'"
        )
    return ""


def _reduced_once(costs: Costs, placement: Placement, ledger: str = "program") -> Costs:
    """`costs` with gradient accumulation reducing once per step. The program
    (`train.unreduced_grads`) gathers each weight whole over the batch's axes once, before
    the micro-batches, in float32, and holds it for the step beside its stored shard; sums
    the micro-batches' gradients whole; reduces once after the last. Nothing precedes the
    gather or follows the reduction in the step, so compute hides neither. A fused trainer
    (DDP's `no_sync`) sums the gradients whole too, and reduces them in buckets during the
    last micro-batch's backward pass, which hides them (`step_cost`). A pipeline already
    reduces once."""
    if costs.stage_axis is not None:
        return costs
    whole = stage_whole(placement)
    once = Formula.of(1)
    program = ledger == "program"
    # a fused trainer's FSDP still gathers its weights for each micro-batch
    once_a_step = {"gather", "reduce"} if program else {"reduce"}
    moved = [
        dataclasses.replace(t, launches=once, overlap="blocking" if program else t.overlap)
        for t in weight_transfers(placement, once, once, STATE_BYTES)
        if t.overlap in once_a_step
    ]
    kept = [t for t in costs.transfers if t.overlap not in once_a_step]
    weights = costs.weights + whole - costs.state["parameters"] if program else costs.weights
    return dataclasses.replace(
        costs, weights=weights, accumulator=whole, transfers=tuple(moved + kept)
    )


def _derive(rules: Rules, compute_dtype: str, remat: bool | str, moe: int, schedule: str) -> Costs:
    """The program ledger's formulas: the rule set placed once, its collectives (moving)
    and its bytes (holding) read off the placement, assembled with the FLOPs; a rule set
    that splits the layers goes to its pipeline schedule's formulas."""
    policy = remat_policy(remat)
    width = DTYPE_BYTES[compute_dtype]
    placement = placed(rules, bool(moe))
    state, gradients, head_gradients, splits = held(placement)
    stage = placement.stage
    if stage is not None and schedule != "lockstep":  # 1F1B's formulas, and ZB's
        return _one_f_one_b(
            placement, (state, head_gradients, tuple(splits)), compute_dtype, policy, moe
        )
    if stage is not None:
        return _pipeline(placement, state, head_gradients, tuple(splits), width)
    layer_gradients = _total(
        (a.elements * STATE_BYTES / "layers").per(
            x for d in a.axes["params"] for x in d if x not in placement.tokens
        )
        for a in placement.arrays
        if "layers" in a.names
    )
    activations, weights, rebuilt = kept_on_device(placement, compute_dtype, policy, moe)
    if moe > DROPLESS:
        kept_copies, working = gathered_experts(placement, width, policy)
        weights, rebuilt = weights + kept_copies, rebuilt + working
    head = per_micro_batch(placement.split(Formula.product(["batch", "seq", "vocab"], LOGIT_BYTES)))
    passes = Formula.of("micro") * (2 if policy else 1)
    transfers = weight_transfers(placement, passes, Formula.of("micro"), width)
    transfers += activation_transfers(
        placement, width, _passes(policy, moe), bool(moe), policy is not None
    )
    accumulator = gradients
    flops = _device_flops(placement, policy, moe)
    extra = _extra(placement, moe=moe, policy=policy)
    return Costs(
        rules,
        state,
        activations,
        weights,
        rebuilt,
        gradients,
        layer_gradients,
        head_gradients,
        accumulator,
        head,
        tuple(transfers),
        flops,
        tuple(splits),
        None,
        **extra,
    )


def _passes(policy: str | None, moe: int) -> int:
    """How often a layer's activations move in a step: forward and backward, and forward
    again when remat rebuilds them (with `dots`, only a mixture's slots are rebuilt)."""
    return 3 if policy == "full" or (policy == "dots" and bool(moe)) else 2


def _extra(
    placement: Placement, pipeline: bool = False, moe: int = 0, policy: str | None = None
) -> dict[str, object]:
    """The batch's and the ring's axes, and the forward pass's and attention's FLOPs per
    device (a pipeline's backward runs its stage's forward again)."""
    rules, ring = placement.rules, placement.ring
    forward = sum((p.forward for p in products(bool(moe), moe > DROPLESS)), Formula())
    return {
        "batch_axes": tuple(a for a in rules.token_axes(rules.axes) if a != ring),
        "ring_axis": ring,
        "forward_flops": (forward * (2 if pipeline else 1)).per(rules.axes),
        "attention_flops": _ring_flops(policy, ring).per(rules.axes),
    }


def _ring_flops(policy: str | None, ring: str | None) -> Formula:
    """Attention's FLOPs per step over all devices, forward, 2.5 times backward (the custom
    VJP scores each block pair again), again under remat. On one device: the block pairs on
    and under the causal diagonal (`products`). On a zig-zag ring (`nnxscale.context`):
    1/2 + 1/(4N) of the query-key pairs (with one block per chunk; smaller blocks score
    fewer)."""
    (scores,) = [p.forward for p in products() if p.name == "attention scores"]
    again = 1 if policy else 0
    if ring is None:
        return scores * (3.5 + again)
    pairs = Formula.product(["layers", "batch", "seq", "seq", "heads", "head_dim"], 4)
    return (pairs * 0.5 + pairs * 0.25 / ring) * (3.5 + again)


def _total(formulas: Iterable[Formula]) -> Formula:
    return sum(formulas, Formula())


def _pipeline(
    placement: Placement,
    state: dict[str, Formula],
    head_gradients: Formula,
    splits: tuple[tuple[str, tuple[str, ...]], ...],
    width: float,
) -> Costs:
    """The formulas of a step on `nnxscale.pipeline`'s executor with a 1F1B schedule of
    `micro` micro-batches over `stage`: each device keeps min(stage, micro) stage inputs and
    one output gradient in its buffers, rebuilds one micro-batch's stage in each backward
    task (the executor recomputes instead of keeping activations), sums its stage's
    gradients whole (gathered once per step over an inner FSDP axis, in float32, and
    reduce-scattered once), and hands an activation forward and a gradient back every tick.
    The last stage also computes the logits of a micro-batch."""
    rules, stage = placement.rules, placement.stage
    whole = stage_whole(placement)
    k = kept("float32" if width == 4 else "bfloat16")
    micro = per_micro_batch(placement.split(Formula.product(["batch", "seq", "embed"], width)))
    slots = Formula.of(stage) + 1  # min(stage, micro) inputs and one gradient, at micro >= stage
    one_stage = (placement.split(k.layer) * "layers").per([stage])
    rebuilt = per_micro_batch(one_stage) + (
        placement.split(k.weights, weights=True) * "layers"
    ).per([stage])
    head = per_micro_batch(
        placement.split(Formula.product(["batch", "seq", "vocab"], 2 * LOGIT_BYTES) + k.model)
    )
    once = Formula.of(1)
    transfers = weight_transfers(placement, once, once, STATE_BYTES)
    ticks = (Formula.of("micro") + stage - 1) * 2
    transfers.append(hand_overs(stage, micro, ticks * 2))
    transfers += in_stages(tensor_all_reduces(placement, width, 3), stage)
    flops = (product_flops(None) * Formula.of(4) / 3).per(rules.axes)  # the backward runs it again
    # the stage's weights, gathered once per step
    weights = whole if placement.tokens else Formula()
    common = (rules, state, whole, head_gradients, splits, stage)
    parts = (micro * slots, weights, rebuilt, head, transfers, flops)
    return _stage_costs(common, *parts, **_extra(placement, pipeline=True))


def _one_f_one_b(
    placement: Placement,
    held: tuple[dict[str, Formula], Formula, tuple[tuple[str, tuple[str, ...]], ...]],
    compute_dtype: str,
    policy: str | None,
    moe: int,
) -> Costs:
    """The formulas of a step on a 1F1B pipeline of `micro` micro-batches over `stage`, one
    program per stage (`SCHEDULES`), with `virtual` stages per device: each device keeps
    its layers' activations (as `remat` says; with full remat each layer's input, split
    over the axes of Megatron's sequence parallelism) for the micro-batches in flight on
    the first device: p (fewer with fewer micro-batches: `flight`, min(p, m)), or
    interleaved p + (p - 1) / v (Korthikanti et al. 2022). It holds
    its stage's weights and gradients whole in float32 (gathered once per step over an
    inner FSDP axis and reduce-scattered once, as Llama 3's FSDP inside stages), runs TP's
    all-reduces and a context ring's hops for its own layers in each of its passes, and
    hands an activation forward and a gradient back at each virtual stage, split as
    sequence parallelism splits them (Megatron-LM's scatter/gather of hand-overs). A
    mixture of experts (`moe`) keeps what its layers keep and runs expert parallelism's
    all-to-alls for its own layers, as outside a pipeline."""
    state, head_gradients, splits = held
    rules, stage, ring = placement.rules, placement.stage, placement.ring
    width = DTYPE_BYTES[compute_dtype]
    whole = stage_whole(placement)
    _, copies, rebuilt = kept_on_device(placement, compute_dtype, policy, moe)
    k = kept(compute_dtype, policy or False, ring=ring is not None, moe=moe)
    blocks = placement.local(k.local) if ring else Formula()
    layer = placement.split_kept(k.layer, k.on_stream("layer")) + _layer_terms(blocks) / "layers"
    layer = per_micro_batch(layer)
    residual = [a for a in rules.axes_of("residual_length") if a != ring]  # Megatron's SP
    in_flight = Formula.of("flight") + (Formula.of("flight") - 1) * "interleaved" / "virtual"
    model = placement.split_kept(k.model, k.on_stream("model")) + blocks - _layer_terms(blocks)
    stage_layers = (layer * "layers").per([stage])
    loss = per_micro_batch(vocab_terms(model))
    activations = stage_layers * in_flight + per_micro_batch(model) - loss
    head = per_micro_batch(placement.split(Formula.product(["batch", "seq", "vocab"], LOGIT_BYTES)))
    once = Formula.of(1)
    transfers = weight_transfers(placement, once, once, STATE_BYTES)
    moved = activation_transfers(
        placement, width, _passes(policy, moe), bool(moe), policy is not None
    )
    transfers += in_stages(moved, stage)
    micro = per_micro_batch(placement.split(Formula.product(["batch", "seq", "embed"], width)))
    micro = micro.per(residual)  # sent split as sequence parallelism splits it (Megatron-LM)
    transfers.append(hand_overs(stage, micro, Formula.of("micro") * "virtual" * 2))
    common = (rules, state, whole, head_gradients, splits, stage)
    weights = (whole if placement.tokens else Formula()) + copies
    flops = _device_flops(placement, policy, moe)
    parts = (activations, weights, rebuilt, head, transfers, flops)
    extra = _extra(placement, moe=moe, policy=policy)
    return _stage_costs(common, *parts, **extra, schedule="1F1B", last_stage=stage_layers + loss)


def vocab_terms(formula: Formula) -> Formula:
    """The terms of `formula` over the vocabulary: the logits and the loss, which a
    pipeline's last stage alone keeps."""
    return Formula({p: c for p, c in formula.terms.items() if "vocab" in dict(p)})


def _layer_terms(formula: Formula) -> Formula:
    """The terms of `formula` that grow with the layers: what every layer keeps."""
    return Formula({p: c for p, c in formula.terms.items() if "layers" in dict(p)})


def _device_flops(placement: Placement, policy: str | None, moe: int) -> Formula:
    """Matmul FLOPs of a step per device: the products over all devices, with attention's as
    the zig-zag ring scores them when a ring splits the sequence; a mixture's routing
    (`ROUTING`) is computed whole on every device of a tensor axis, unless sequence
    parallelism splits the stream it routes over that axis."""
    rules, ring = placement.rules, placement.ring
    flops = product_flops(policy, bool(moe), dropless=moe > DROPLESS)
    if ring is not None:
        flops += _ring_flops(policy, ring) - _ring_flops(policy, None)
    if not moe:
        return flops.per(rules.axes)
    routing = product_flops(policy, True, ROUTING)
    tensor = set(placement.tensor("mlp")) - set(rules.axes_of("residual_length"))
    return (flops - routing).per(rules.axes) + routing.per(a for a in rules.axes if a not in tensor)


def _stage_costs(
    common: tuple,
    activations: Formula,
    weights: Formula,
    rebuilt: Formula,
    head: Formula,
    transfers: list[Transfer],
    flops: Formula,
    **extra: object,
) -> Costs:
    """A pipeline's `Costs`: what every schedule shares (`common`: the rule set, the state,
    the stage's whole weights and gradients, the head's gradients, the splits, the stage
    axis), and what its schedule sets."""
    rules, state, whole, head_gradients, splits, stage = common
    return Costs(
        rules,
        state,
        activations,
        weights,
        rebuilt,
        whole,
        Formula(),
        head_gradients,
        whole,
        head,
        tuple(transfers),
        flops,
        splits,
        stage,
        **extra,
    )
