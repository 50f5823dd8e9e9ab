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

Options beside the top-k routing: shared experts that every token passes through (DeepSeek,
Qwen), the router's z-loss (ST-MoE: the mean squared log-sum-exp of its logits, which keeps
them small). The load-balancing loss is Switch's E sum_e f_e P_e with f_e the share of all
k T copies that expert e received (DeepSeek's form); GShard's in `nnxscale.moe` counts first
choices only.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxscale.model.moe import MoEError, largest
from nnxscale.placement.layout import activation_axis


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


PRODUCTS = jax.checkpoint_policies.save_only_these_names("expert product")
"""What a block's step keeps for the backward pass: its rows (the step's input) and its
gate and up products, not its expert's weights."""


def grouped_swiglu(
    x: jax.Array, owner: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
    """Each block of rows of `x` (blocks x block x d) through its owner's SwiGLU network, one
    block a step of a scan (the products of the rows alone, on any backend). The backward
    pass keeps each block's values but not its expert's weights, which it slices again: kept,
    they would cost a copy of an expert per block."""
    dtype = x.dtype

    @partial(jax.checkpoint, policy=PRODUCTS)
    def step(_: None, inputs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        rows, e = inputs
        gated = checkpoint_name(rows @ gate[e].astype(dtype), "expert product")
        hidden = jax.nn.silu(gated) * checkpoint_name(rows @ up[e].astype(dtype), "expert product")
        return None, hidden @ down[e].astype(dtype)

    return jax.lax.scan(step, None, (x, owner))[1]


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


def route(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, Routed]:
    """Top-k routing of `logits` (tokens x experts): the gates (softmax probabilities,
    renormalised over the k choices when k > 1), the choices, and the losses."""
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise MoEError(f"top_k={top_k} with {experts} experts: use 1 <= top_k <= {experts}.")
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    gates, chosen = largest(probs, top_k)
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
) -> tuple[jax.Array, Routed]:
    """The dropless layer on one group of tokens (x: tokens x d): route, sort the k copies
    into blocks, run each block through its expert, gather back and weigh by the gates."""
    tokens, d = x.shape
    experts = router.shape[1]
    gates, chosen, routed = route(x.astype(jnp.float32) @ router, top_k)
    placed = sort_by_expert(chosen, gates, experts, block)
    n = placed.owner.shape[0]
    copies = jnp.broadcast_to(x[:, None, :], (tokens, top_k, d)).reshape(-1, d)
    rows = jnp.zeros((n * block, d), x.dtype).at[placed.rows.reshape(-1)].set(copies)
    out = grouped_swiglu(rows.reshape(n, block, d), placed.owner, gate, up, down)
    picked = out.reshape(n * block, d)[placed.rows]  # tokens x k x d
    y = jnp.einsum("tk,tkd->td", gates.astype(x.dtype), picked)
    return y, dataclasses.replace(routed, dropped=lost(placed.rows, n * block))


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
    experts: a module (the Transformer's dense MLP, wider) that every token passes through."""

    def __init__(
        self,
        embed: int,
        mlp: int,
        experts: int,
        *,
        top_k: int = 2,
        shared: nnx.Module | None = None,
        block: int = 8,
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

    def __call__(self, x: jax.Array) -> tuple[jax.Array, Routed]:
        """The layer's output for `x` (groups x tokens x d), each group routed on its own, and
        how it routed them (losses averaged over the groups)."""

        split = activation_axis("experts")
        if split is not None:
            raise MoEError(
                f"dropless experts under rules that split them (over {split[0]!r}) would "
                "gather every expert onto every device: the library has no token exchange "
                "for dropless routing. Use DP or FSDP rules, or routing='capacity' (GShard's) "
                "for expert parallelism."
            )
        weights = (self.router[...], self.gate[...], self.up[...], self.down[...])

        def one(group: jax.Array) -> tuple[jax.Array, Routed]:
            return dropless(group, *weights, top_k=self.top_k, block=self.block)

        y, routed = jax.vmap(one)(x)
        if self.shared is not None:
            y = y + self.shared(x)
        means = {k: getattr(routed, k).mean() for k in ("aux_loss", "z_loss", "dropped")}
        return y, dataclasses.replace(routed, **means)
