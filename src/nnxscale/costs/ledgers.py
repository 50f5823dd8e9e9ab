"""Two memory ledgers: what this library's compiled program keeps, and what a trainer with
fused kernels keeps.

`program` is the book's own step: the activations JAX's autodiff keeps for the book's
Transformer (`nnxscale.activations`, traced), float32 norm intermediates and unfused SwiGLU
products included; the gradients held as XLA's partitioner splits them (as the optimizer
state that reads them); a reduction once a step after the loop over micro-batches. The
chapters assert it against compiled programs.

`fused` is what Megatron-LM, torchtitan, MaxText and nanotron keep for a model of the same
family: flash attention (no score, a float32 log-sum-exp per query and head), fused norms
and every intermediate in the compute dtype. Per layer and token, the textbook's least:
the two norms' inputs and outputs (4E), queries and the attention's output (2HD), keys and
values (2KD) and SwiGLU's gate, up and product (3F), which for GPT's shape is Korthikanti et
al.'s 34 s b h. Under sequence parallelism the whole layer is split over the tensor axis
(Megatron-LM gathers a product's input again in its backward pass). The loss is by default
a fused cross-entropy (flash-attention's, Liger's, Megatron-LM's
`--cross-entropy-loss-fusion`): it keeps the logits in the compute dtype and writes their
gradient in their place; a loss on float32 logits (`Setup.loss`) keeps more. Gradients are
held as the rule set's `grads` role says (frameworks that reduce them by hand keep ZeRO-1's
whole) in one buffer that sums the micro-batches and that the optimizer reads in place, a
pipeline runs one program per stage (1F1B and zero-bubble schedules, not the
book's lockstep executor), and a reduction once a step overlaps the last micro-batch's
backward pass (DDP's buckets, Megatron-LM's overlapped reduction).

This is the derivation's third stage, holding: like the second (`nnxscale.costs.moves`) it
reads a rule set's `Placement` (`nnxscale.costs.arrays`), and `nnxscale.costs.derive`
assembles what both give.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from nnxscale.costs.activations import DROPLESS, kept
from nnxscale.costs.arrays import Placement, per_micro_batch
from nnxscale.costs.counts import DTYPE_BYTES, OPTIMIZER_COPIES, SIZES, STATE_BYTES
from nnxscale.costs.formula import Formula


def layer_values(
    compute_dtype: str, moe: int = 0, policy: str | None = None, regather: bool = True
) -> tuple[Formula, Formula]:
    """What one fused layer keeps for its backward pass, in bytes of whole arrays (`moe` as
    `nnxscale.activations.mixture` gives it), and the part of it on the residual stream,
    which sequence parallelism splits. Without remat: the norms' inputs and outputs (4E),
    queries and the attention's output (2HD), keys and values (2KD), gate, up and their
    product (3F). Under the dots policy the products' outputs and the layer's input: the
    input and the two output projections' outputs (3E, on the stream), queries, keys and
    values and the attention's output (2HD + 2KD), gate and up (2F); the norms and the
    product are computed again. Flash attention keeps a float32 log-sum-exp per query and
    head either way. Without `regather`, the inputs of the attention's and the MLP's first
    products are kept as the products read them, gathered whole over sequence
    parallelism's tensor axis (2E, off the stream)."""
    w = DTYPE_BYTES[compute_dtype]
    dots = policy == "dots"
    stream = Formula.product(["batch", "seq", "embed"], (3 if dots else 4) * w)
    attention = Formula.product(["batch", "seq", "embed"], 0 if regather else 2 * w)
    attention += Formula.product(["batch", "seq", "heads", "head_dim"], 2 * w)
    attention += Formula.product(["batch", "seq", "kv_heads", "head_dim"], 2 * w)
    attention += Formula.product(["batch", "seq", "heads"], STATE_BYTES)  # log-sum-exp
    products = 2 if dots else 3
    if not moe:
        mlp = Formula.product(["batch", "seq", "mlp"], products * w)
    else:
        rows = ["batch", "rows"] if moe > DROPLESS else ["batch", "experts", "capacity"]
        mlp = Formula.product([*rows, "mlp"], products * w)
        mlp += Formula.product([*rows, "embed"], w)
        mlp += Formula.product(["batch", "seq", "experts"], STATE_BYTES)  # the router's
    return stream + attention + mlp, stream


def fused(
    costs: object,
    placement: Placement,
    compute_dtype: str,
    policy: str | None,
    moe: int,
    how: tuple[str, bool] = ("fused", True),
) -> object:
    """`costs` (a `nnxscale.costs.Costs` of the program ledger) with the fused ledger's
    activations, working set, loss and gradients (`how`: the loss, as
    `nnxscale.costs.LOSSES` says, and whether the products gather their inputs again):
    the state, the collectives and the FLOPs stay the program's."""
    w = DTYPE_BYTES[compute_dtype]
    loss, regather = how
    layer, stream = layer_values(compute_dtype, moe, regather=regather)
    if policy == "full":  # each layer keeps its input; one layer is rebuilt in its backward
        kept = kept_stream = Formula.product(["batch", "seq", "embed"], w)
    else:
        kept, kept_stream = layer_values(compute_dtype, moe, policy, regather)
    per_layer = per_micro_batch(placement.split_kept(kept, kept_stream))
    outside = Formula.product(["batch", "seq", "embed"], 3 * w)  # embedding out, last norm
    float32 = loss == "float32"
    logits = Formula.product(["batch", "seq", "vocab"], w + 2 * STATE_BYTES * float32)
    model = per_micro_batch(placement.split_kept(outside + logits, outside))
    stage = costs.stage_axis
    last_stage = Formula()
    if stage is None:
        activations = per_layer * "layers" + model
    else:
        in_flight = Formula.of("flight") + (Formula.of("flight") - 1) * "interleaved" / "virtual"
        stage_layers = (per_layer * "layers").per([stage])
        loss = per_micro_batch(placement.split(logits))
        activations = stage_layers * in_flight + model - loss
        last_stage = stage_layers + loss
    mlp_width = "batch rows mlp" if moe > DROPLESS else "batch experts capacity mlp"
    working = Formula.product((mlp_width if moe else "batch seq mlp").split(), 3 * w)
    rebuilt = placement.split_kept(layer, stream) if policy else Formula()
    rebuilt = per_micro_batch(rebuilt + placement.split(working))
    grads = _gradients(placement)
    return dataclasses.replace(
        costs,
        activations=activations,
        rebuilt=rebuilt,
        head=per_micro_batch(
            placement.split(Formula.product(["batch", "seq", "vocab"], STATE_BYTES * float32))
        ),
        weights=_gathered(placement, w, staged=stage is not None),
        gradients=grads["all"],
        layer_gradients=grads["layer"] if stage is None else Formula(),
        head_gradients=grads["head"],
        accumulator=grads["all"],
        last_stage=last_stage,
        in_place=True,
    )


def _gradients(placement: Placement) -> dict[str, Formula]:
    """Per device, in float32: every gradient, one layer's and the head's, held as the rule
    set's `grads` role splits them."""
    tokens = placement.tokens
    found = {"all": Formula(), "layer": Formula(), "head": Formula()}
    for a in placement.arrays:
        held = a.per_device("grads")
        found["all"] += held
        if a.path == "head":
            found["head"] += held
        if "layers" in a.names:
            split = {x for d in a.axes["params"] for x in d if x not in tokens}
            found["layer"] += (a.elements * STATE_BYTES / "layers").per(split)
    return found


def _gathered(placement: Placement, width: int, staged: bool) -> Formula:
    """A fused trainer's compute-dtype copies of the weights it splits over the batch's axes
    (FSDP): outside a pipeline, the layer at work and the next, prefetched; inside stages,
    the stage's whole, kept from the forward pass to the backward (Llama 3's FSDP does not
    reshard after the forward pass). Weights held whole need no copy: their parameters are
    kept in the compute dtype (`Precision.parameters`)."""
    whole = _total(
        placement.gathered(a)
        for a in placement.arrays
        if (staged or "layers" in a.names) and placement.stored_over_tokens(a)
    )
    return whole * width if staged else whole / "layers" * (2 * width)


def held(placement: Placement) -> tuple[dict[str, Formula], Formula, Formula, tuple]:
    """The train state per device (parameters, optimizer state), the gradients held, the
    head's gradients, and every (size, axes) that splits a dimension of an array."""
    arrays = placement.arrays
    state = {
        "parameters": _total(a.per_device("params") for a in arrays),
        "optimizer state": _total(a.per_device("optimizer") for a in arrays) * OPTIMIZER_COPIES,
    }
    # gradients are held as the optimizer state that reads them is split: XLA's partitioner
    # splits a gradient only a split update reads, whatever the rule set says of `grads`
    gradients = _total(a.per_device("optimizer") for a in arrays)
    head_gradients = _total(a.per_device("optimizer") for a in arrays if a.path == "head")
    splits = {
        (SIZES[n], axes)
        for a in arrays
        for role in a.axes.values()
        for n, axes in zip(a.names, role, strict=True)
        if axes
    }
    return state, gradients, head_gradients, tuple(sorted(splits))


WORKSPACE = Formula.product(["batch", "heads", "block", "block"], 4 * 4)
"""What the blockwise attention's backward pass holds while it runs one layer: about four
float32 arrays of one block pair's scores (the scores, probabilities and their gradients),
measured on the compiled kernel; it grows with the block, not with the sequence."""


def mlp_gradients(width: int, moe: int) -> Formula:
    """What one layer's MLP holds while its backward pass runs, beside what it kept: three
    gradients as wide as its hidden units (of the down projection's input, of gate and of
    up), over every token, every expert's slot in a capacity mixture, or every row of a
    dropless mixture's blocks (`moe` as `nnxscale.activations.mixture` gives it)."""
    hidden = "batch seq mlp"
    if moe:
        hidden = "batch rows mlp" if moe > DROPLESS else "batch experts capacity mlp"
    return Formula.product(hidden.split(), 3 * width)


def kept_on_device(
    placement: Placement, compute_dtype: str, policy: str | None, moe: int
) -> tuple[Formula, Formula, Formula]:
    """Per device: the activations the backward pass reads, the compute copies of the
    weights (when the compute dtype or a token axis needs them), and what remat rebuilds."""
    ring = placement.ring
    k = kept(compute_dtype, policy or False, ring=ring is not None, moe=moe)
    stream = k.on_stream("layer") * "layers" + k.on_stream("model")
    activations = per_micro_batch(
        placement.split_kept(k.layer * "layers" + k.model, stream) + placement.local(k.local)
    )
    copies = compute_dtype != "float32" or any(
        placement.stored_over_tokens(a) for a in placement.arrays
    )
    weights = Formula()
    if copies:
        weights = placement.split(k.weights * "layers" + k.head_weights, weights=True)
    rebuilt = placement.split(k.rebuilt + WORKSPACE) if ring is None else placement.local(k.rebuilt)
    gradients = placement.split(mlp_gradients(DTYPE_BYTES[compute_dtype], moe))
    rebuilt = per_micro_batch(rebuilt + gradients)
    if policy and copies:
        rebuilt += placement.split(kept(compute_dtype).weights, weights=True)
    return activations, weights, rebuilt


def gathered_experts(
    placement: Placement, width: float, policy: str | None
) -> tuple[Formula, Formula]:
    """A dropless mixture's experts where the tokens' axes split them (FSDP): its blocks read
    them whole (`nnxscale.dropless`), so each layer keeps its gathered copy for the backward
    pass (unless full remat rebuilds it), and the layer at work holds that copy and its
    gradient whole twice (measured on the compiled steps: about three layers' worth)."""
    whole = _total(
        a.elements
        for a in placement.arrays
        if "experts" in a.names and len(a.names) > 3 and placement.stored_over_tokens(a)
    )
    kept_copies = Formula() if policy == "full" else whole * width
    return kept_copies, whole / "layers" * (width + 2 * STATE_BYTES)


def stage_whole(placement: Placement) -> Formula:
    """A stage's parameters per device, whole over the axes that split the batch (an inner
    FSDP axis; a mixture's experts stay split over expert parallelism's axis), in float32:
    what a pipeline gathers once a step and sums gradients into."""
    return _total(placement.gathered(a) * STATE_BYTES for a in placement.arrays)


def _total(formulas: Iterable[Formula]) -> Formula:
    return sum(formulas, Formula())
