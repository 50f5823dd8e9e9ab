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
"""

from __future__ import annotations

import dataclasses

from nnxscale.costs.activations import DROPLESS
from nnxscale.costs.arrays import PlacedArray, per_micro_batch, split_by, split_kept
from nnxscale.costs.counts import DTYPE_BYTES, STATE_BYTES
from nnxscale.costs.formula import Formula
from nnxscale.placement.constraints import ROUTED
from nnxscale.placement.rules import Rules


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
    rules: Rules,
    arrays: list[PlacedArray],
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
    per_layer = per_micro_batch(split_kept(kept, kept_stream, rules))
    outside = Formula.product(["batch", "seq", "embed"], 3 * w)  # embedding out, last norm
    float32 = loss == "float32"
    logits = Formula.product(["batch", "seq", "vocab"], w + 2 * STATE_BYTES * float32)
    model = per_micro_batch(split_kept(outside + logits, outside, rules))
    stage = costs.stage_axis
    last_stage = Formula()
    if stage is None:
        activations = per_layer * "layers" + model
    else:
        in_flight = Formula.of("flight") + (Formula.of("flight") - 1) * "interleaved" / "virtual"
        stage_layers = (per_layer * "layers").per([stage])
        loss = per_micro_batch(split_by(logits, rules))
        activations = stage_layers * in_flight + model - loss
        last_stage = stage_layers + loss
    mlp_width = "batch rows mlp" if moe > DROPLESS else "batch experts capacity mlp"
    working = Formula.product((mlp_width if moe else "batch seq mlp").split(), 3 * w)
    rebuilt = split_kept(layer, stream, rules) if policy else Formula()
    rebuilt = per_micro_batch(rebuilt + split_by(working, rules))
    grads = _gradients(arrays, rules)
    return dataclasses.replace(
        costs,
        activations=activations,
        rebuilt=rebuilt,
        head=per_micro_batch(
            split_by(Formula.product(["batch", "seq", "vocab"], STATE_BYTES * float32), rules)
        ),
        weights=_gathered(rules, arrays, w, staged=stage is not None),
        gradients=grads["all"],
        layer_gradients=grads["layer"] if stage is None else Formula(),
        head_gradients=grads["head"],
        accumulator=grads["all"],
        last_stage=last_stage,
        in_place=True,
    )


def _gradients(arrays: list[PlacedArray], rules: Rules) -> dict[str, Formula]:
    """Per device, in float32: every gradient, one layer's and the head's, held as the rule
    set's `grads` role splits them."""
    tokens = set(rules.token_axes(rules.axes))
    found = {"all": Formula(), "layer": Formula(), "head": Formula()}
    for a in arrays:
        held = a.per_device("grads")
        found["all"] += held
        if a.path == "head":
            found["head"] += held
        if "layers" in a.names:
            split = {x for d in a.axes["params"] for x in d if x not in tokens}
            found["layer"] += (a.elements * STATE_BYTES / "layers").per(split)
    return found


def _gathered(rules: Rules, arrays: list[PlacedArray], width: int, staged: bool) -> Formula:
    """A fused trainer's compute-dtype copies of the weights it splits over the batch's axes
    (FSDP): outside a pipeline, the layer at work and the next, prefetched; inside stages,
    the stage's whole, kept from the forward pass to the backward (Llama 3's FSDP does not
    reshard after the forward pass). Weights held whole need no copy: their parameters are
    kept in the compute dtype (`Precision.parameters`)."""
    tokens = set(rules.token_axes(rules.axes))
    split = [
        a
        for a in arrays
        if (staged or "layers" in a.names) and tokens & {x for d in a.axes["params"] for x in d}
    ]
    whole = sum(
        (
            a.elements.per(
                x
                for name, d in zip(a.names, a.axes["params"], strict=True)
                for x in d
                if name in ROUTED or x not in tokens
            )
            for a in split
        ),
        Formula(),
    )
    return whole * width if staged else whole / "layers" * (2 * width)
