"""Dropless experts: every token reaches all k of its experts, on grouped matrix products.

Today's mixtures (Mixtral, DeepSeek, Qwen3-MoE) drop no token: there is no capacity. The
router scores each token against every expert and keeps its top k; the k copies of each token
are sorted by expert, so that each expert's tokens lie in one run of rows, and each run is
padded to whole blocks of `block` rows. A scan computes each block with its own expert's
weights (MegaBlocks' block-sparse grouped product, Gale et al. 2023). Shapes are static, so
the scan always runs the blocks the worst balance needs, ceil(kT / b) + E - 1: the products
cost the tokens' k copies plus (E - 1) b rows and the last partial block, whatever the
balance (blocks of 8 rows suit the book's small CPU models; an accelerator wants 128 to 512,
enough rows a weight read to keep its matrix units busy). The outputs are gathered back in
token order and summed with the router's weights.

`jax.lax.ragged_dot` is JAX's primitive for a grouped product. It is not used here: XLA
compiles it as one dense product masked per expert, E times the work, on the CPU and, measured
on one H200 (jax 0.11.2, `benchmarks/experts.py`, the expert products alone, without routing,
sorting or gathering), on that GPU too. There, for a Mixtral 8x7B layer's experts forward and
backward, the tokens' products ran at 89 to 94 TFLOP/s by `ragged_dot`, 242 (4,096 tokens,
1.44 times the copies' products computed) to 323 (16,384 tokens, 1.11 times) by these blocks
of 512 rows, and 487 to 496 by GShard's capacity dispatch at a factor of 1.25 (1.41 times, its
dispatch products included), which drops what overflows. Dropless costs the padding and a
scan; it buys no dropped token and memory linear in the tokens.

Expert parallelism (rules that split `experts` over a mesh axis, EP and FSDP+EP) runs the layer
in `jax.shard_map`: each device routes its own sequences, tells every device how many copies it
will send to each of its experts (an all-to-all of counts), then sends the copies (an
all-to-all), computes what its experts received and sends the results back (a third). The
buffers have static shapes, so each destination's slice holds all k T of the device's copies,
the most that could go there: the exchange moves n times the copies' bytes over an axis of n,
padding that `jax.lax.ragged_all_to_all` would not send, but which XLA's CPU backend does not
implement (measured: UNIMPLEMENTED on jaxlib 0.12). A device's blocks past those that received
rows are skipped at run time.

Options beside the top-k routing: shared experts that every token passes through (DeepSeek,
Qwen), the router's z-loss (ST-MoE: the mean squared log-sum-exp of its logits, which keeps
them small), and a router bias that balances the experts without a loss (DeepSeek-V3: the
bias is added to the scores only to choose, and each step moves it by a fixed rate toward the
experts that received fewer copies; `RouterBias`). The load-balancing loss is Switch's
E sum_e f_e P_e with f_e the share of all k T copies that expert e received (DeepSeek's form);
GShard's in `nnxscale.moe` counts first choices only.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from nnxscale.core.steered import Steered
from nnxscale.model.moe import MoEError, check_experts, largest
from nnxscale.placement.constraints import activation_axis, activation_spec, constrain
from nnxscale.placement.mesh import constrain_to


def blocks(assignments: int, experts: int, block: int) -> int:
    """Blocks of `block` rows that hold `assignments` token copies sorted by expert, whatever
    their balance: each expert's run is padded to whole blocks, which adds less than one block
    per expert (ceil(a / b) + E - 1)."""
    return -(-assignments // block) + experts - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sorted:
    """Where each of the tokens' k copies lies among the blocks: `rows[t, j]` is the row of
    token t's j-th choice, `owner[b]` the expert of block b, `load[e]` the copies expert e
    received; with the `gates` that weigh each copy and the `chosen` experts."""

    rows: jax.Array
    owner: jax.Array
    load: jax.Array
    gates: jax.Array
    chosen: jax.Array


def sort_by_expert(chosen: jax.Array, gates: jax.Array, experts: int, block: int) -> Sorted:
    """The block layout of `chosen` (tokens x k expert indices): copies sorted by expert (in
    token order within an expert), each expert's run starting on a block boundary."""
    flat = chosen.reshape(-1)
    load = jnp.sum(jax.nn.one_hot(flat, experts, dtype=jnp.int32), axis=0)
    padded = -(-load // block) * block
    start = jnp.cumsum(padded) - padded  # each expert's first row
    first = jnp.cumsum(load) - load  # each expert's first copy in sorted order
    order = jnp.argsort(flat, stable=True)
    position = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.size, dtype=flat.dtype))
    rows = start[flat] + position - first[flat]
    n = blocks(flat.size, experts, block)
    ends = jnp.cumsum(padded)
    owner = jnp.searchsorted(ends, jnp.arange(n) * block, side="right")
    owner = jnp.minimum(owner, experts - 1).astype(jnp.int32)  # blocks past the end: empty
    return Sorted(rows.reshape(chosen.shape), owner, load, gates, chosen)


INPUT = ("batch", "residual_length", "embed")
"""The logical names of the layer's input: the residual stream's (`transformer.RESIDUAL`)."""

PRODUCTS = jax.checkpoint_policies.save_only_these_names("expert product")
"""What a block's step keeps for the backward pass: its rows (the step's input) and its
gate and up products, not its expert's weights."""


def grouped_swiglu(
    x: jax.Array,
    owner: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    used: jax.Array | None = None,
) -> jax.Array:
    """Each block of rows of `x` (blocks x block x d) through its owner's SwiGLU network, one
    block a step of a scan (the products of the rows alone, on any backend). The backward
    pass keeps each block's values but not its expert's weights, which it slices again: kept,
    they would cost a copy of an expert per block. Given `used`, the blocks from that index
    on are skipped at run time (a conditional; their rows come out zero)."""
    dtype = x.dtype

    def swiglu(rows: jax.Array, e: jax.Array) -> jax.Array:
        gated = checkpoint_name(rows @ gate[e].astype(dtype), "expert product")
        hidden = jax.nn.silu(gated) * checkpoint_name(rows @ up[e].astype(dtype), "expert product")
        return hidden @ down[e].astype(dtype)

    @partial(jax.checkpoint, policy=PRODUCTS)
    def step(i: jax.Array, inputs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        rows, e = inputs
        if used is None:
            return i + 1, swiglu(rows, e)
        return i + 1, jax.lax.cond(i < used, swiglu, lambda r, _: jnp.zeros_like(r), rows, e)

    start = jnp.zeros((), jnp.int32) if used is None else jnp.zeros_like(used)
    return jax.lax.scan(step, start, (x, owner))[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routed:
    """What routing a group's tokens did: the experts each token chose and the copies each
    expert received (`load`), Switch's load-balancing loss, the router's z-loss, and the share
    of copies the blocks lost (`dropped`: a row outside the blocks or taken twice), zero where
    the layout is right, as against GShard's `Routing.dropped`."""

    chosen: jax.Array
    load: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    dropped: jax.Array


class RouterBias(Steered):
    """A router's per-expert bias for choosing experts, not for weighing them: DeepSeek-V3's
    balance without an auxiliary loss. The loss does not train it. Its gradient carries the
    copies each expert received in the step (`loads_as_gradient`), combined over micro-batches
    and devices as gradients are, and the train step moves it by its `rate` metadata toward
    the experts that received fewer than the mean (`steered`)."""

    def steered(self, statistic: jax.Array) -> jax.Array:
        """b + rate x sign(mean load - load), from the step's loads (DeepSeek-V3's rule)."""
        step = self.get_metadata()["rate"] * jnp.sign(statistic.mean(-1, keepdims=True) - statistic)
        return self[...] + step


@jax.custom_vjp
def loads_as_gradient(bias: jax.Array, load: jax.Array) -> jax.Array:
    """`bias` itself, whose gradient is `load`, whatever the loss: how the loads of a step
    reach the step that moves the bias."""
    return bias


def _loads_forward(bias: jax.Array, load: jax.Array) -> tuple[jax.Array, jax.Array]:
    return bias, load


def _loads_backward(load: jax.Array, _: jax.Array) -> tuple[jax.Array, jax.Array]:
    return load, jnp.zeros_like(load)


loads_as_gradient.defvjp(_loads_forward, _loads_backward)


def with_loads(routed: Routed, bias: jax.Array | None) -> Routed:
    """`routed`, whose balance loss gains zero times the `bias` passed through
    `loads_as_gradient`: the bias's gradient is then the copies its experts received in all
    of `routed`'s groups (summed here, outside any `vmap` over them)."""
    if bias is None:
        return routed
    load = routed.load.reshape(-1, routed.load.shape[-1]).sum(0).astype(jnp.float32)
    probe = 0.0 * jnp.sum(loads_as_gradient(bias, load))
    return dataclasses.replace(routed, aux_loss=routed.aux_loss + probe)


def route(
    logits: jax.Array, top_k: int, bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, Routed]:
    """Top-k routing of `logits` (tokens x experts): the gates (softmax probabilities,
    renormalised over the k choices when k > 1), the choices, and the losses. With a `bias`
    (experts), the choices are the top k of the probabilities plus the bias, the gates still
    the probabilities (`with_loads` makes the loads the bias's gradient)."""
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise MoEError(f"top_k={top_k} with {experts} experts: use 1 <= top_k <= {experts}.")
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    if bias is None:
        gates, chosen = largest(probs, top_k)
    else:
        chosen = largest(probs + jax.lax.stop_gradient(bias), top_k)[1]
        gates = jnp.take_along_axis(probs, chosen, axis=-1)
    if top_k > 1:
        gates = gates / gates.sum(axis=-1, keepdims=True)
    load = jnp.sum(jax.nn.one_hot(chosen, experts, dtype=jnp.int32), axis=(0, 1))
    share = load.astype(jnp.float32) / (tokens * top_k)
    aux = experts * jnp.sum(share * probs.mean(axis=0))
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return gates, chosen, Routed(chosen, load, aux, z, jnp.zeros((), jnp.float32))


def dropless(
    x: jax.Array,
    router: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    top_k: int,
    block: int,
    bias: jax.Array | None = None,
) -> tuple[jax.Array, Routed]:
    """The dropless layer on one group of tokens (x: tokens x d): route (by the router's
    `bias` too, if given), sort the k copies into blocks, run each block through its expert,
    gather back and weigh by the gates."""
    tokens, d = x.shape
    experts = router.shape[1]
    gates, chosen, routed = route(x.astype(jnp.float32) @ router, top_k, bias)
    placed = sort_by_expert(chosen, gates, experts, block)
    n = placed.owner.shape[0]
    copies = jnp.broadcast_to(x[:, None, :], (tokens, top_k, d)).reshape(-1, d)
    rows = jnp.zeros((n * block, d), x.dtype).at[placed.rows.reshape(-1)].set(copies)
    out = grouped_swiglu(rows.reshape(n, block, d), placed.owner, gate, up, down)
    picked = out.reshape(n * block, d)[placed.rows]  # tokens x k x d
    y = jnp.einsum("tk,tkd->td", gates.astype(x.dtype), picked)
    return y, dataclasses.replace(routed, dropped=lost(placed.rows, n * block))


def send_layout(chosen: jax.Array, experts: int, devices: int) -> tuple[jax.Array, jax.Array]:
    """Where each of the k copies of a device's tokens goes in its send buffer, and how many
    copies go to each expert of each device. The buffer holds `devices` slices of k T rows,
    one per destination, each big enough for all of them: slice j's copies first, sorted by
    expert, then padding. Returns the copies' rows (T x k) and the counts (devices x E / n)."""
    flat = chosen.reshape(-1)
    local = experts // devices
    load = jnp.sum(jax.nn.one_hot(flat, experts, dtype=jnp.int32), axis=0)
    rank = jnp.zeros_like(flat).at[jnp.argsort(flat, stable=True)].set(jnp.arange(flat.size))
    to = flat // local
    per_device = load.reshape(devices, local).sum(axis=1)
    first = jnp.cumsum(per_device) - per_device  # each device's first copy in sorted order
    rows = to * flat.size + rank - first[to]
    return rows.reshape(chosen.shape), load.reshape(devices, local)


def received_experts(counts: jax.Array, capacity: int) -> jax.Array:
    """The local expert of each received row, from the counts each source sent first (its
    rows arrive sorted by expert); `counts.shape[1]` (no expert) for a padding row."""
    ends = jnp.cumsum(counts, axis=1)
    row = jnp.arange(capacity)
    return jax.vmap(lambda e: jnp.searchsorted(e, row, side="right"))(ends).reshape(-1)


def _exchanged(
    rows: jax.Array, counts: jax.Array, weights: tuple[jax.Array, ...], axis: str, block: int
) -> jax.Array:
    """One device's part of the exchange: the counts, then the rows (devices x k T x d) go
    to their experts' devices (two all-to-alls); its own experts compute what arrived, sorted
    into blocks of `block` rows (padding rows skipped); the results go back the same way."""
    tiled = partial(jax.lax.all_to_all, axis_name=axis, split_axis=0, concat_axis=0, tiled=True)
    devices, capacity, d = rows.shape
    local = counts.shape[1]
    expert = received_experts(tiled(counts), capacity)
    placed = sort_by_expert(expert[:, None], expert[:, None], local + 1, block)
    used = jnp.sum(-(-placed.load[:local] // block))  # blocks of rows that arrived
    n = placed.owner.shape[0]
    arrived = tiled(rows).reshape(-1, d)
    inputs = jnp.zeros((n * block, d), rows.dtype).at[placed.rows[:, 0]].set(arrived)
    owner = jnp.minimum(placed.owner, local - 1)
    out = grouped_swiglu(inputs.reshape(n, block, d), owner, *weights, used=used)
    back = out.reshape(n * block, d)[placed.rows[:, 0]]
    return tiled(back.reshape(devices, capacity, d))


def exchange_bytes(
    tokens: int, top_k: int, embed: int, devices: int, experts: int, itemsize: int
) -> tuple[int, int]:
    """Bytes of the arrays one device's all-to-alls hold in one layer's forward pass, for
    `tokens` tokens on the device: (the counts, int32, devices x experts / devices; the copies,
    sent there and back, each a buffer of devices x k T rows of `embed`). The backward pass
    moves the copies' gradients twice more (2 x the copies' bytes) and no counts."""
    return experts * 4, 2 * devices * top_k * tokens * embed * itemsize


def _varying_like(w: jax.Array, x: jax.Array) -> jax.Array:
    """`w` marked as varying over every mesh axis `x` varies over, inside `jax.shard_map`."""
    have, want = (jax.typeof(a).manual_axis_type.varying for a in (w, x))
    missing = tuple(sorted(want - have))
    return jax.lax.pcast(w, missing, to="varying") if missing else w


def expert_parallel_local(
    x: jax.Array,
    router: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    bias: jax.Array | None = None,
    *,
    axis: str,
    top_k: int,
    block: int,
) -> tuple[jax.Array, Routed]:
    """The program one device runs inside `jax.shard_map`: route its sequences (x: groups x
    tokens x d, each group routed on its own, as on one device), send every copy to the
    device of its expert and back (`_exchanged`), and weigh the results by the gates."""
    groups, tokens, d = x.shape
    devices, experts = jax.lax.axis_size(axis), router.shape[1]
    # Varying over the tokens' axes from the start: the gradients' sums over those axes then
    # run once, after the pass, not inside a block that only some devices compute.
    router, gate, up, down = (_varying_like(w, x) for w in (router, gate, up, down))
    logits = x.astype(jnp.float32) @ router
    if bias is not None:
        bias = _varying_like(bias, x)
    gates, chosen, routed = jax.vmap(lambda g: route(g, top_k, bias))(logits)
    slots, counts = send_layout(chosen.reshape(-1, top_k), experts, devices)
    copies = jnp.broadcast_to(x[:, :, None], (groups, tokens, top_k, d)).reshape(-1, d)
    capacity = copies.shape[0]
    send = jnp.zeros((devices * capacity, d), x.dtype).at[slots.reshape(-1)].set(copies)
    back = _exchanged(send.reshape(devices, capacity, d), counts, (gate, up, down), axis, block)
    picked = back.reshape(-1, d)[slots].reshape(groups, tokens, top_k, d)
    y = jnp.einsum("gtk,gtkd->gtd", gates.astype(x.dtype), picked)
    dropped = jnp.broadcast_to(lost(slots, devices * capacity), (groups,))
    return y, with_loads(dataclasses.replace(routed, dropped=dropped), bias)


def expert_parallel(
    x: jax.Array,
    weights: tuple[jax.Array, ...],
    *,
    top_k: int,
    block: int,
    bias: jax.Array | None = None,
) -> tuple[jax.Array, Routed]:
    """The dropless layer on `x` (groups x tokens x d) under rules that split the experts over
    a mesh axis: in `jax.shard_map` over the active mesh, each device routes its own groups
    and exchanges the copies with the devices of their experts (`expert_parallel_local`).
    The experts are read split over that axis alone (gathered over any other, as FSDP does)
    and the router whole; the groups stay as the rules split them, their tokens whole."""
    axis, devices = activation_axis("experts")
    check_experts(weights[0].shape[1], devices, axis)
    spec, mesh = activation_spec(x.shape, INPUT)
    if any(tuple(spec)[1:]):
        raise MoEError(
            f"dropless expert parallelism routes each device's whole sequences, and the rules "
            f"split them as {spec}: keep the sequence and embedding dimensions whole (EP or "
            "FSDP+EP rules)."
        )
    rows = PartitionSpec(*tuple(spec)[:1])
    weights += () if bias is None else (bias,)
    specs = (PartitionSpec(), *[PartitionSpec(axis)] * 3, PartitionSpec())[: len(weights)]
    weights = tuple(
        constrain_to(w, NamedSharding(mesh, s)) for w, s in zip(weights, specs, strict=True)
    )
    routed = Routed(*[rows] * 5)
    body = partial(expert_parallel_local, axis=axis, top_k=top_k, block=block)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, *specs), out_specs=(spec, routed))(
        x, *weights
    )


def lost(rows: jax.Array, capacity: int) -> jax.Array:
    """The share of copies whose row lies outside the `capacity` rows of the blocks or is
    taken by another copy too: what a wrong layout would drop or overwrite."""
    flat = rows.reshape(-1)
    inside = (flat >= 0) & (flat < capacity)
    taken = jnp.zeros((capacity,), jnp.int32).at[jnp.where(inside, flat, capacity)]
    taken = taken.add(1, mode="drop")
    twice = jnp.sum(jnp.maximum(taken - 1, 0))
    return (jnp.sum(~inside) + twice).astype(jnp.float32) / flat.size


def dense_reference(
    x: jax.Array,
    router: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    top_k: int,
) -> jax.Array:
    """The same layer the slow, obvious way: every token through every expert, weighted by
    its gate at its k chosen experts and by zero elsewhere."""
    gates, chosen, _ = route(x.astype(jnp.float32) @ router, top_k)
    weights = jnp.sum(jax.nn.one_hot(chosen, router.shape[1]) * gates[..., None], axis=1)
    dtype = x.dtype
    hidden = jax.nn.silu(jnp.einsum("td,edf->tef", x, gate.astype(dtype)))
    hidden = hidden * jnp.einsum("td,edf->tef", x, up.astype(dtype))
    every = jnp.einsum("tef,efd->ted", hidden, down.astype(dtype))
    return jnp.einsum("te,ted->td", weights.astype(dtype), every)


class Dropless(nnx.Module):
    """A dropless mixture-of-experts feed-forward layer: a router, `experts` stacked SwiGLU
    MLPs (gate, up, down, with the logical axis `experts`) and, if `shared` is given, shared
    experts: a module (the Transformer's dense MLP, wider) that every token passes through.
    With a `bias_rate`, the router chooses by a `RouterBias` too, which each train step moves
    by that rate toward balance (DeepSeek-V3's rule; its 0.001 is for sigmoid scores, which
    are larger than these softmax probabilities of about 1/E)."""

    def __init__(
        self,
        embed: int,
        mlp: int,
        experts: int,
        *,
        top_k: int = 2,
        shared: nnx.Module | None = None,
        block: int = 8,
        bias_rate: float = 0.0,
        rngs: nnx.Rngs,
    ) -> None:
        if experts < 1:
            raise MoEError(f"experts={experts}: a mixture needs at least one expert.")
        if not 1 <= top_k <= experts:
            raise MoEError(f"top_k={top_k} with {experts} experts: use 1 <= top_k <= {experts}.")
        if block < 1:
            raise MoEError(f"block={block}: blocks hold at least one row.")

        def normal(shape: tuple[int, ...], fan_in: int) -> jax.Array:
            return jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)

        def stacked(n: int, a: int, b: int, names: tuple[str, ...]) -> nnx.Param:
            return nnx.Param(normal((n, a, b), a), out_sharding=names)

        self.router = nnx.Param(normal((embed, experts), embed), out_sharding=("embed", None))
        self.gate = stacked(experts, embed, mlp, ("experts", "embed", "mlp"))
        self.up = stacked(experts, embed, mlp, ("experts", "embed", "mlp"))
        self.down = stacked(experts, mlp, embed, ("experts", "mlp", "embed"))
        self.shared = shared
        self.top_k, self.block = top_k, block
        bias = RouterBias(jnp.zeros(experts), rate=bias_rate, out_sharding=(None,))
        self.bias = bias if bias_rate > 0 else None

    def __call__(self, x: jax.Array) -> tuple[jax.Array, Routed]:
        """The layer's output for `x` (groups x tokens x d), each group routed on its own, and
        how it routed them (losses averaged over the groups)."""

        weights = (self.router[...], self.gate[...], self.up[...], self.down[...])
        options = {
            "top_k": self.top_k,
            "block": self.block,
            "bias": None if self.bias is None else self.bias[...],
        }
        if activation_axis("experts") is not None:
            y, routed = expert_parallel(x, weights, **options)
        else:
            # whole on every device (FSDP's gather, once a layer): a block's slice of a split
            # weight, taken at each group's own expert, would move the rows to the weights
            weights = (weights[0], *(constrain(w, (None,) * w.ndim) for w in weights[1:]))
            y, routed = jax.vmap(lambda group: dropless(group, *weights, **options))(x)
            routed = with_loads(routed, options["bias"])
        if self.shared is not None:
            y = y + self.shared(x)
        means = {k: getattr(routed, k).mean() for k in ("aux_loss", "z_loss", "dropped")}
        return y, dataclasses.replace(routed, **means)
