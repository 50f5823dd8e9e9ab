"""What a training step keeps for its backward pass, calibrated against JAX's autodiff.

The book's Transformer is traced once, abstractly, with every size a different prime (2
sequences of 3 tokens, 5 key/value heads of 2 x 53 dimensions, each read by 43 query heads, width
11, MLP 13, vocabulary 17, 19 layers). Each array
autodiff keeps (`nnxscale.memory.residual_arrays`) then factors into those primes, which
names its shape: an array of 2 x 5 x 3 x 3 float32 values is `4 * batch * heads * seq^2`
bytes, the attention probabilities. The sum over arrays is a `Formula` that holds for any
size of the model, for the compute dtype and remat policy traced: the activation term of the
memory ledger is what the code asks to keep, not a formula written beside it.

Context parallelism runs attention as a ring inside `jax.shard_map`, whose kept arrays depend
on the ring's size: its model is traced on an abstract mesh (no devices) with rings of 2 and 3
devices, each sequence cut into chunks of 2 x 23 tokens per device, and the formula is what
the two traces have in common plus what each hop adds.

A mixture of experts is traced with 37 experts whose capacity per group is itself a prime
(the capacity factor is chosen to make it one), so that `experts` and `capacity` name their
dimensions too. Its routing places the k choices of each token in a scan, so what it keeps
per choice is stacked along a dimension of k, and a trace at k = 23 names it `top_k`. A
mixture with one choice is traced at k = 1 (its gates are not renormalised). A dropless
mixture (`nnxscale.dropless`) is traced with 59 experts in blocks of one row, so that a
sequence's rows of blocks, k seq + E - 1, are a prime too and name the `rows` dimension.

Megatron's sequence parallelism splits the residual stream along the sequence: the dense model
is traced once more under TP+SP, on Explicit axes of one device, where each kept array's type
carries its placement; those whose sequence is placed as `residual_length` are `Kept.stream`.

Attention keeps its queries grouped by key/value head (`nnxscale.context.grouped`): a
dimension of 43 is `groups`, and `kv_heads` x `groups` is read back as `heads`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from nnxscale.core.memory import residual_arrays
from nnxscale.costs.counts import mixture_problem
from nnxscale.costs.formula import Formula
from nnxscale.model.config import Config, remat_policy
from nnxscale.model.losses import next_token_loss
from nnxscale.model.transformer import create
from nnxscale.placement.catalogue import CONTEXT, CP, SP
from nnxscale.placement.constraints import activation_rules

GROUPS = 43
"""Query heads per key/value head in the traced model: `heads` is `kv_heads` x 43."""

PRIMES = {
    "batch": 2,
    "seq": 3,
    "kv_heads": 5,
    "heads": 5 * GROUPS,
    "head_dim": 2 * 53,
    "embed": 11,
    "mlp": 13,
    "vocab": 17,
    "layers": 19,
}
"""The size each dimension takes in the traced model: distinct primes (`head_dim` twice one,
since rotary embeddings turn pairs; a dimension is matched to the largest size first), so
that every array's shape factors into the dimensions it is made of."""

RING_PRIMES = {
    "batch": 29,
    "kv_heads": 5,
    "heads": 5 * GROUPS,
    "head_dim": 2 * 31,
    "embed": 11,
    "mlp": 13,
    "vocab": 17,
    "layers": 19,
}
"""The sizes of the traced context-parallel model: `seq` is 2 x context x 23 there (two chunks
of 23 tokens per device, the zig-zag layout), so no size may be 2, 3 or 23."""

HALF_CHUNK = 23
RINGS = (2, 3)
"""The ring sizes the context-parallel model is traced with."""

EXPERTS = 37
"""The experts of the traced mixture."""

TOP_K = 23
CAPACITY = 41
"""The choices per token (when more than one) and the slots per expert and group of the
traced mixture: primes that no other size is."""

DROPLESS = 2
"""What `mixture` adds for dropless routing."""

DROPLESS_EXPERTS = 59
"""The experts of the traced dropless mixture, in blocks of one row: a sequence's rows,
k seq + E - 1 (`nnxscale.dropless.blocks`), are 61 at k = 1 and 127 at k = `TOP_K`, primes
no other size is."""

LOGICAL = {"batch": "batch", "seq": "length", "layers": "layers"}
"""The logical axis name of each traced dimension, where it differs from the size's name."""


def factor(size: int, units: Mapping[str, int] = PRIMES) -> Counter[str]:
    """The dimensions an array's dimension of `size` is made of: `units` divided out, the
    largest first."""
    found: Counter[str] = Counter()
    left = size
    for name, unit in sorted(units.items(), key=lambda kv: -kv[1]):
        while left > 1 and left % unit == 0:
            found[name] += 1
            left //= unit
    if left != 1:
        raise ValueError(
            f"a kept array has a dimension of {size}, which is not a product of the traced "
            f"sizes {dict(units)}: the model computes a size the calibration cannot name"
        )
    return found


@dataclasses.dataclass(frozen=True)
class Kept:
    """Bytes a step keeps for its backward pass, as formulas in the model's sizes (whole
    arrays: `nnxscale.costs` divides them among devices). `layer` is what each layer keeps
    (its terms in `batch` grow with the tokens; a few, such as its norms' scales, do not) and
    `model` what the embeddings, the final norm, the head and the loss keep. `weights` are
    the compute-dtype copies of one layer's matrices that its backward pass reads, and
    `head_weights` the output head's: in float32 they are the parameters themselves unless
    a strategy gathers them. `rebuilt` is what one rematerialised layer holds again while its
    backward pass runs, besides its weight copies (zero without remat). `local` holds the
    ring's blocks, kept inside `jax.shard_map` (zero without a ring): already per device
    along the sequence, in `chunk`, the tokens of a sequence each device holds. `stream`
    holds the part of `layer` and `model` kept on the residual stream (the norms' inputs and
    statistics, the residual adds), which Megatron's sequence parallelism splits along the
    sequence (`residual_length`); None where it was not traced (a mixture). A layer being
    rebuilt is priced whole: compiled, its stream saves nothing (`tests/test_costs.py`)."""

    layer: Formula
    model: Formula
    weights: Formula
    head_weights: Formula
    rebuilt: Formula
    local: Formula = dataclasses.field(default_factory=Formula)
    stream: Kept | None = None

    def on_stream(self, name: str) -> Formula:
        """The part of formula `name` kept on the residual stream (zero where not traced)."""
        return Formula() if self.stream is None else getattr(self.stream, name)

    def json(self) -> dict[str, object]:
        """Every formula as JSON."""
        return {
            f.name: None if getattr(self, f.name) is None else getattr(self, f.name).json()
            for f in dataclasses.fields(self)
        }


Traced = dict[tuple[int, bool, bool], Formula]
"""Formulas of kept arrays by (power of `layers`, has a `batch` dimension, kept per device)."""


def mixture(cfg: Config) -> int:
    """How the model's MLP is traced (`kept`'s `moe`): 0 dense; GShard's capacity routing
    whose tokens choose one expert (1) or several (2); dropless routing, one (3) or several
    (4) (`DROPLESS`). `nnxscale.costs.mixture_problem` refuses what is not traced."""
    if cfg.experts and mixture_problem(cfg):
        raise ValueError(mixture_problem(cfg))
    if not cfg.experts:
        return 0
    return min(cfg.top_k, 2) + (DROPLESS if cfg.routing == "dropless" else 0)


def _traced(
    cfg: Config,
    dropout: bool,
    batch: int,
    seq: int,
    ring: int = 0,
    units: Mapping[str, int] = PRIMES,
    stream: bool = False,
) -> Traced:
    """The arrays autodiff keeps for the loss of `batch` sequences of `seq` tokens, as
    formulas in the sizes of `units`; with `ring` > 0, traced under context parallelism over
    a ring of that size; with `stream`, only those on the residual stream (`_on_stream`)."""
    model = nnx.eval_shape(lambda: create(cfg))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype) if dropout else None

    def loss(p: nnx.State, t: jax.Array, k: jax.Array | None) -> jax.Array:
        rngs = None if k is None else nnx.Rngs(dropout=k)
        return next_token_loss(nnx.merge(graphdef, p, rest), t, rngs)

    if ring:
        units = {**RING_PRIMES, "seq": seq, "chunk": seq // ring, CONTEXT: ring}
        mesh = AbstractMesh((1, ring), CP.axes, axis_types=(AxisType.Auto,) * 2)
        with activation_rules(CP, mesh):
            arrays = residual_arrays(loss, params, tokens, key)
    elif stream:  # SP on Explicit axes of one device: each kept array's type has its placement
        mesh = AbstractMesh((1, 1), SP.axes, axis_types=(AxisType.Explicit,) * 2)
        rows = NamedSharding(mesh, PartitionSpec(SP.axes_of("batch")))
        tokens = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=rows)
        with jax.sharding.use_abstract_mesh(mesh), activation_rules(SP, mesh):
            arrays = residual_arrays(loss, params, tokens, key)
        arrays = [a for a in arrays if _on_stream(a, units["seq"])]
    else:
        arrays = residual_arrays(loss, params, tokens, key)
    found: Traced = {}
    units = {**units, "groups": GROUPS}
    for array in arrays:
        names: Counter[str] = Counter()
        for size in array.shape:
            names.update(factor(size, units))
        while names["groups"] and names["kv_heads"]:  # queries grouped by key/value head
            names.subtract({"groups": 1, "kv_heads": 1})
            names["heads"] += 1
        names = +names
        layers = names.pop("layers", 0)
        stacked = names.pop(CONTEXT, 0)  # one block per ring device: what one device keeps
        if layers > 1 or stacked > 1:
            raise ValueError(f"a kept array of shape {array.shape} repeats a dimension")
        slot = (layers, "batch" in names, bool(stacked))
        found[slot] = found.get(slot, Formula()) + Formula.product(
            names.elements(), array.dtype.itemsize
        )
    return found


def _on_stream(array: jax.ShapeDtypeStruct, seq: int) -> bool:
    """Whether a kept array traced under `SP` lies on the residual stream: its dimension of
    `seq` tokens placed as `residual_length` (SP's `model`, where `length` stays whole)."""
    split = set(SP.axes_of("residual_length"))
    return any(
        size == seq and split & set(_axes(part))
        for size, part in zip(array.shape, array.sharding.spec, strict=False)
    )


def _axes(part: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes of one entry of a partition spec."""
    return () if part is None else (part,) if isinstance(part, str) else tuple(part)


def _config(policy: str | None, dropout: bool, sizes: Mapping[str, int], max_len: int) -> Config:
    fixed = {k: v for k, v in sizes.items() if k not in ("batch", "seq")}
    return Config(
        **fixed,
        max_len=max_len,
        scan_layers=True,
        remat=policy or False,
        dropout=0.1 if dropout else 0.0,
    )


def _linear(small: Formula, large: Formula, at: tuple[int, int], name: str) -> Formula:
    """The formula a + `name` x b that is `small` and `large` where `name` is `at`."""
    each = (large - small) / (at[1] - at[0])
    return small - each * at[0] + each * name


def _moe_traced(cfg: Config, dropout: bool, top_k: int, slots: int) -> Traced:
    """`_traced` for a mixture of `EXPERTS` experts of which each token chooses `top_k`,
    with a capacity factor that gives each expert `slots` slots per group."""
    seq = PRIMES["seq"]
    factor = (slots - 0.5) * EXPERTS / (top_k * seq)
    mixed = cfg.replace(experts=EXPERTS, top_k=top_k, capacity_factor=factor)
    units = {**PRIMES, "experts": EXPERTS, "capacity": slots}
    if top_k > 1:
        units["top_k"] = top_k
    return _traced(mixed, dropout, PRIMES["batch"], seq, units=units)


def _dropless_traced(cfg: Config, dropout: bool, top_k: int) -> Traced:
    """`_traced` for a dropless mixture of `DROPLESS_EXPERTS` experts of which each token
    chooses `top_k`, in blocks of one row, so that its `rows` are a prime (what a block of
    more rows keeps per block, its expert's index, is then counted per row: a few bytes)."""
    seq = PRIMES["seq"]
    mixed = cfg.replace(experts=DROPLESS_EXPERTS, top_k=top_k, routing="dropless", expert_block=1)
    units = {**PRIMES, "experts": DROPLESS_EXPERTS, "rows": top_k * seq + DROPLESS_EXPERTS - 1}
    if top_k > 1:
        units["top_k"] = top_k
    return _traced(mixed, dropout, PRIMES["batch"], seq, units=units)


@functools.cache
def _trace(cfg: Config, dropout: bool, moe: int) -> Traced:
    """What autodiff keeps for `cfg` at the primes, dense (`moe` 0) or as a mixture whose
    tokens choose one expert or `top_k` (`mixture`); once per process, since every compute
    dtype's `kept` reads both the float32 and the bfloat16 trace (read it, do not change
    it)."""
    if not moe:
        return _traced(cfg, dropout, PRIMES["batch"], PRIMES["seq"])
    top_k = 1 if moe % DROPLESS == 1 else TOP_K
    if moe > DROPLESS:
        return _dropless_traced(cfg, dropout, top_k)
    return _moe_traced(cfg, dropout, top_k, CAPACITY)


@functools.cache
def _stream(cfg: Config, dropout: bool) -> Traced:
    """What a dense `cfg` keeps on the residual stream, at the primes (read it, do not change
    it)."""
    return _traced(cfg, dropout, PRIMES["batch"], PRIMES["seq"], stream=True)


def _pick(found: Traced, layers: int, local: bool = False, batch: bool | None = None) -> Formula:
    """The formulas of `found` with that power of `layers`, kept per device or not, with or
    without a `batch` dimension (either, if None)."""
    return sum(
        (
            f
            for (n, b, here), f in found.items()
            if n == layers and here == local and batch in (None, b)
        ),
        Formula(),
    )


@functools.cache
def kept(
    compute_dtype: str = "float32",
    remat: bool | str = False,
    dropout: bool = False,
    ring: bool = False,
    moe: int = 0,
) -> Kept:
    """The activations the book's Transformer keeps, traced in `compute_dtype` with the remat
    policy `remat` (`nnxscale.model.REMAT_POLICIES`), with or without dropout, with or
    without a context-parallel ring, and with a dense MLP or a mixture of experts (`moe`, as
    `mixture` gives it). The weight copies are what a bfloat16 trace keeps beyond a float32
    one (where the weights are the parameters), at the compute dtype's width."""
    policy = remat_policy(remat)
    if ring and moe:
        raise ValueError(
            "the activations of a mixture of experts under context parallelism are not "
            "calibrated: trace one or the other"
        )
    if ring:
        return _ring_kept(compute_dtype, policy, dropout)
    cfg = _config(policy, dropout, PRIMES, PRIMES["seq"])
    traces = {
        dtype: _trace(cfg.replace(compute_dtype=dtype), dropout, moe)
        for dtype in {"float32", "bfloat16", compute_dtype}
    }
    found = traces[compute_dtype]

    def copies(layers: int) -> Formula:  # only weights have no batch dimension and differ
        cast = _pick(traces["bfloat16"], layers, batch=False) - _pick(
            traces["float32"], layers, batch=False
        )
        return cast * (jnp.dtype(compute_dtype).itemsize / 2)

    layer, model = _pick(found, 1), _pick(found, 0)
    if compute_dtype != "float32":
        layer, model = layer - copies(1), model - copies(0)
    stream = None
    if not moe:  # a mixture's stream is not traced apart: sequence parallelism splits none
        streams = _stream(cfg.replace(compute_dtype=compute_dtype), dropout)
        stream = Kept(_pick(streams, 1), _pick(streams, 0), Formula(), Formula(), Formula())
    rebuilt = Formula()
    if policy is not None:
        rebuilt = kept(compute_dtype, False, dropout, moe=moe).layer - layer
    return Kept(layer, model, copies(1), copies(0), rebuilt, stream=stream)


@functools.cache
def _ring(compute_dtype: str, policy: str | None, dropout: bool) -> tuple[Formula, ...]:
    """Under context parallelism, the formulas of what a layer and the rest of the model keep
    (whole arrays) and what a layer's and the model's ring blocks keep (per device, in
    `chunk`): each trace's formula is a + ring x b (what every ring keeps, and what each hop
    adds), solved from rings of `RINGS` devices."""
    traces = []
    for ring in RINGS:
        seq = 2 * ring * HALF_CHUNK
        cfg = _config(policy, dropout, RING_PRIMES, seq).replace(compute_dtype=compute_dtype)
        traces.append(_traced(cfg, dropout, RING_PRIMES["batch"], seq, ring))

    def solve(layers: int, local: bool) -> Formula:
        small, large = (_pick(t, layers, local) for t in traces)
        whole = _linear(small, large, RINGS, CONTEXT)
        return whole if local else whole.replace("chunk", {"seq": 1, CONTEXT: -1})

    return solve(1, False), solve(0, False), solve(1, True), solve(0, True)


def _ring_kept(compute_dtype: str, policy: str | None, dropout: bool) -> Kept:
    """`kept` under context parallelism (`_ring`)."""
    dense = kept(compute_dtype, policy or False, dropout)
    layer, model, local_layer, local_model = _ring(compute_dtype, policy, dropout)
    if compute_dtype != "float32":
        layer, model = layer - dense.weights, model - dense.head_weights
    rebuilt = Formula()
    if policy is not None:
        whole = _ring_kept(compute_dtype, None, dropout)
        rebuilt = whole.layer - layer + _ring(compute_dtype, None, dropout)[2] - local_layer
    local = local_layer * "layers" + local_model
    # the ring leaves the residual stream outside `jax.shard_map`, as the dense model keeps it
    return Kept(layer, model, dense.weights, dense.head_weights, rebuilt, local, dense.stream)
