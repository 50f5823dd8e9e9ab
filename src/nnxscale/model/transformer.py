"""The book's decoder-only Transformer in Flax NNX, every parameter named with logical axes.

A decoder of today's family (Llama, Qwen, Mistral): grouped-query attention with rotary
position embeddings and blockwise (flash-style) attention, a SwiGLU MLP, RMSNorm, no biases;
tied embeddings and QK-norm as options. Parameters carry logical axis names (`vocab`,
`embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `layers`) in Flax's `out_sharding`
metadata, never mesh axis names: a rule set (`nnxscale.rules`) maps them onto a mesh, so one
model serves every parallel strategy. Its sizes and switches are a `Config`
(`nnxscale.model.config`), which this module builds the modules from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxscale.model.casting import compute_copy
from nnxscale.model.config import REMAT_POLICIES, Config, remat_policy
from nnxscale.model.context import (
    Ring,
    context_split,
    flash_attention,
    from_layout,
    ring_attention,
    to_layout,
)
from nnxscale.model.dropless import Dropless, Routed
from nnxscale.model.losses import cross_entropy
from nnxscale.model.moe import MoE, Routing
from nnxscale.placement.constraints import (
    activation_spec,
    alongside,
    constrain,
    placed_einsum,
    placed_lookup,
)
from nnxscale.placement.rounds import group_layers, layer_rounds

LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "experts")

HEADS = ("batch", "length", "heads", "head_dim")
"""Logical names of the queries (and the attention's output before projection)."""

KV_HEADS = ("batch", "length", "kv_heads", "head_dim")
"""Logical names of the keys and values: `kv_heads` of them, each read by `heads / kv_heads`
query heads (grouped-query attention)."""

TOKENS = ("batch", "length", "embed")
"""Logical names of the input of attention and of the MLP: under sequence parallelism,
where the residual stream's sequence is gathered whole again."""

HIDDEN = ("batch", "length", "mlp")
"""Logical names of the MLP's hidden activations."""

LOGITS = ("batch", "length", "vocab")
"""Logical names of the logits: split over the vocabulary as the output head is."""

RESIDUAL = ("batch", "residual_length", "embed")
"""Logical names of the residual stream: the embeddings, each block's output, and the norms
and dropout between them (Megatron's sequence parallelism splits `residual_length`)."""


def _param(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    fan_in: int | None,
    dtype: str = "float32",
) -> nnx.Param:
    """A parameter with logical axis names: normal(0, 1/fan_in) values, or ones if no fan_in,
    drawn in float32 and stored in `dtype`."""
    if fan_in is None:
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)
    return nnx.Param(value.astype(dtype), out_sharding=axes)


class RMSNorm(nnx.Module):
    """Root-mean-square normalisation over the last dimension, with a learned scale: of the
    residual stream (`embed`), or of each query and key head (`head_dim`, QK-norm)."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs, axis: str = "embed") -> None:
        size = cfg.head_dim if axis == "head_dim" else cfg.embed
        self.scale = _param(rngs, (size,), (axis,), None, cfg.param_dtype)
        self.eps = cfg.norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + self.eps)
        return (normed * alongside(compute_copy(self.scale, jnp.float32), normed)).astype(x.dtype)


def rotary(positions: Any, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """The cosines and sines (length, head_dim) that turn each pair of dimensions (i,
    i + head_dim / 2) of a query or key at each position by position x theta^(-2i/head_dim)."""
    inverse = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.asarray(positions, jnp.float32)[:, None] * inverse[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Heads `x` (batch, length, heads, head_dim) turned by the rotary angles, in float32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    turned = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[None, :, None, :] + turned * sin[None, :, None, :]).astype(x.dtype)


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary positions, computed blockwise (never
    the whole score matrix); heads split the projections (column/row parallel)."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        e, d, dtype = cfg.embed, cfg.head_dim, cfg.param_dtype
        self.query = _param(rngs, (e, cfg.heads, d), ("embed", "heads", "head_dim"), e, dtype)
        kv, names = (e, cfg.kv_heads, d), ("embed", "kv_heads", "head_dim")
        self.key = _param(rngs, kv, names, e, dtype)
        self.value = _param(rngs, kv, names, e, dtype)
        self.out = _param(
            rngs, (cfg.heads, d, e), ("heads", "head_dim", "embed"), cfg.heads * d, dtype
        )
        if cfg.qk_norm:
            self.query_norm = RMSNorm(cfg, rngs=rngs, axis="head_dim")
            self.key_norm = RMSNorm(cfg, rngs=rngs, axis="head_dim")
        self.cfg = cfg

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype, length = x.dtype, x.shape[1]
        x = constrain(x, TOKENS)
        q = placed_einsum("ble,ehd->blhd", x, compute_copy(self.query, dtype), HEADS)
        k = placed_einsum("ble,ehd->blhd", x, compute_copy(self.key, dtype), KV_HEADS)
        v = constrain(
            placed_einsum("ble,ehd->blhd", x, compute_copy(self.value, dtype), KV_HEADS), KV_HEADS
        )
        if self.cfg.qk_norm:
            q, k = self.query_norm(q), self.key_norm(k)
        ring = context_split(length)
        cos, sin = rotary(
            np.arange(length) if ring is None else ring.order(length),
            self.cfg.head_dim,
            self.cfg.rope_theta,
        )
        q = constrain(rotate(q, cos, sin), HEADS)
        k = constrain(rotate(k, cos, sin), KV_HEADS)
        context = self.attend(q, k, v, ring)
        return placed_einsum("blhd,hde->ble", context, compute_copy(self.out, dtype), RESIDUAL)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, ring: Ring | None) -> jax.Array:
        """Blockwise causal attention: each device's own heads and sequences through the
        one-device kernel (`flash_attention`), or around the ring that splits the sequence.
        Where the rules split the query heads but cannot split the key/value heads alike (a
        tensor axis larger than `kv_heads`), each key/value head is first repeated for its
        query heads."""
        placed = activation_spec(q.shape, HEADS)
        if placed is None:
            return flash_attention(q, k, v)
        spec, mesh = placed
        kv_spec, _ = activation_spec(k.shape, KV_HEADS)
        if tuple(kv_spec)[2:3] != tuple(spec)[2:3]:
            k, v = (repeat_heads(x, self.cfg.groups) for x in (k, v))
        if ring is not None:
            return ring_attention(q, k, v, mesh, ring, spec=spec)
        return jax.shard_map(flash_attention, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(
            q, k, v
        )


def repeat_heads(x: jax.Array, groups: int) -> jax.Array:
    """Keys or values (batch, length, kv_heads, head_dim) with each head repeated for the
    `groups` query heads that read it, placed as queries are: a product with a 0/1 matrix,
    exact, which places its result on Explicit axes as any product does."""
    kv = x.shape[2]
    expand = jnp.repeat(jnp.eye(kv, dtype=x.dtype), groups, axis=1)
    return constrain(placed_einsum("blkd,kh->blhd", x, expand, HEADS), HEADS)


class MLP(nnx.Module):
    """SwiGLU feed-forward block, silu(x W_gate) * (x W_up) then W_down; `mlp` splits it
    column- then row-parallel."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        e, m, dtype = cfg.embed, cfg.mlp, cfg.param_dtype
        self.gate = _param(rngs, (e, m), ("embed", "mlp"), e, dtype)
        self.up = _param(rngs, (e, m), ("embed", "mlp"), e, dtype)
        self.down = _param(rngs, (m, e), ("mlp", "embed"), m, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(x, TOKENS)
        gate = placed_einsum("ble,em->blm", x, compute_copy(self.gate, x.dtype), HIDDEN)
        up = placed_einsum("ble,em->blm", x, compute_copy(self.up, x.dtype), HIDDEN)
        hidden = constrain(jax.nn.silu(gate) * up, HIDDEN)
        return placed_einsum("blm,me->ble", hidden, compute_copy(self.down, x.dtype), RESIDUAL)


def _feed_forward(cfg: Config, rngs: nnx.Rngs) -> nnx.Module:
    """A layer's feed-forward network: the dense MLP, or a mixture routed as `cfg` says."""
    if not cfg.experts:
        return MLP(cfg, rngs=rngs)
    sizes = (cfg.embed, cfg.mlp, cfg.experts)
    if cfg.routing == "dropless":
        wide = cfg.shared_experts * cfg.mlp
        shared = MLP(cfg.replace(mlp=wide), rngs=rngs) if wide else None
        extra = {"shared": shared, "block": cfg.expert_block, "bias_rate": cfg.bias_rate}
        return Dropless(*sizes, top_k=cfg.top_k, rngs=rngs, **extra)
    return MoE(*sizes, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor, rngs=rngs)


class Block(nnx.Module):
    """One pre-norm Transformer layer: attention and MLP, each with dropout on its output."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.attention_norm = RMSNorm(cfg, rngs=rngs)
        self.attention = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg, rngs=rngs)
        self.mlp = _feed_forward(cfg, rngs)
        self.loss_weights = (cfg.aux_weight, cfg.z_weight)  # of the balance loss, the z-loss
        self.dropout = nnx.Dropout(cfg.dropout)

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None) -> jax.Array:
        return self.with_aux(x, dropout_key)[0]

    def with_aux(self, x: jax.Array, dropout_key: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """The layer's output and its weighted auxiliary loss (zero for a dense MLP)."""
        x, routing = self.with_routing(x, dropout_key)
        if routing is None:
            return x, jnp.zeros((), jnp.float32)
        aux = self.loss_weights[0] * routing.aux_loss
        if isinstance(routing, Routed):
            aux = aux + self.loss_weights[1] * routing.z_loss
        return x, aux

    def with_routing(
        self, x: jax.Array, dropout_key: jax.Array | None
    ) -> tuple[jax.Array, Routing | Routed | None]:
        """The layer's output and, for a mixture of experts, how it routed its tokens (each
        sequence is one group)."""
        keys = (None, None) if dropout_key is None else tuple(jax.random.split(dropout_key))
        x = constrain(x + self._drop(self.attention(self.attention_norm(x)), keys[0]), RESIDUAL)
        h, routing = self.mlp_norm(x), None
        if isinstance(self.mlp, (MoE, Dropless)):
            h, routing = self.mlp(h)
        else:
            h = self.mlp(h)
        return constrain(x + self._drop(h, keys[1]), RESIDUAL), routing

    def _drop(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
        return self.dropout(x, deterministic=key is None, rngs=key)


def _stacked_blocks(cfg: Config, rngs: nnx.Rngs) -> Block:
    """`cfg.layers` blocks whose parameters are stacked on a leading `layers` axis."""

    @nnx.split_rngs(splits=cfg.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=rngs)

    return create(rngs)


BlockRunner = Callable[
    ["Transformer", jax.Array, "jax.Array | None"], "tuple[jax.Array, jax.Array | None]"
]
"""`blocks(model, x, keys) -> (output, summed load-balancing loss or None)`: how
`Transformer.loss` runs the blocks (hand-written FSDP and the pipeline bring their own)."""


class Transformer(nnx.Module):
    """Decoder-only language model: token embeddings, blocks, final norm, output head.

    It runs on meshes of either kind (`nnxscale.mesh.AXIS_TYPES`): its activations are
    placed by their logical names under the active rules, on Explicit axes in the types of
    its products and lookups (`out_sharding=`), on Auto axes by constraints the compiler
    honours."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab, cfg.embed), ("vocab", "embed"), 1, cfg.param_dtype)
        if cfg.scan_layers:
            self.blocks = _stacked_blocks(cfg, rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.final_norm = RMSNorm(cfg, rngs=rngs)
        if not cfg.tie_embeddings:
            shape = (cfg.embed, cfg.vocab)
            self.head = _param(rngs, shape, ("embed", "vocab"), cfg.embed, cfg.param_dtype)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], seed: int = 0) -> Transformer:
        """The Transformer a checkpoint's record describes (its `Config` as a dict)."""
        return create(Config(**config), seed)

    def __call__(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        """Logits (batch, length, vocab) for integer tokens (batch, length); dropout if keyed."""
        keys = None if dropout_key is None else self.layer_keys(dropout_key)
        return self.unembed(self.run_blocks(self.embed_tokens(tokens), keys)[0])

    def loss(
        self,
        tokens: jax.Array,
        keys: jax.Array | None = None,
        blocks: BlockRunner | None = None,
    ) -> jax.Array:
        """The book's loss on `tokens` (batch, length + 1), written once: embed, the blocks,
        then the head and the loss (`head_loss`). `blocks(model, x, keys)` runs the blocks
        (default `run_blocks`): hand-written FSDP and the pipeline plug their runners in."""
        x = self.embed_tokens(tokens[:, :-1])
        y, aux = blocks(self, x, keys) if blocks else self.run_blocks(x, keys)
        return self.head_loss(y, tokens[:, 1:], aux)

    def head_loss(self, y: jax.Array, targets: jax.Array, aux: jax.Array | None) -> jax.Array:
        """Mean cross-entropy of `targets` under the head's logits for the blocks' output `y`,
        plus, with experts, the layers' mean auxiliary loss (`aux`, their sum: each layer's
        load-balancing loss times `aux_weight`, and a dropless router's z-loss times
        `z_weight`). A runner that returns no `aux` cannot train experts, and is refused."""
        loss = cross_entropy(self.unembed(y), targets)
        if not self.cfg.experts:
            return loss
        if aux is None:
            raise ValueError(
                "these blocks run without the experts' load-balancing loss, which training "
                "would drop: train a mixture of experts with the rule sets (nx.EP, nx.FSDP_EP)"
            )
        return loss + aux / self.cfg.layers

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The blocks' input: the tokens' embeddings in the compute dtype (positions enter
        attention as rotations). Under context parallelism the sequence is put in the
        zig-zag layout here, once."""
        cfg = self.cfg
        length = tokens.shape[1]
        if length > cfg.max_len:
            raise ValueError(f"sequence length {length} exceeds max_len {cfg.max_len}")
        split = context_split(length)
        if split is not None:
            tokens = to_layout(tokens, split)
        # a lookup follows its table's layout: rows split as the logits' vocabulary, so the
        # lookup runs on this device's sequences, and columns whole, gathered as a weight
        batch = ((tokens.shape[0], "batch"),)
        table = constrain(self.embed[...], ("vocab", None), beside=batch)
        x = placed_lookup(table, tokens, RESIDUAL)
        return constrain(x.astype(jnp.dtype(cfg.compute_dtype)), RESIDUAL)

    def routings(self, tokens: jax.Array) -> list[Routing | Routed]:
        """How each layer's experts routed `tokens` (no dropout): what a chapter plots. One
        compiled program per shape of `tokens` (op by op, every op would compile anew)."""
        if self.cfg.scan_layers or not self.cfg.experts:
            raise ValueError(
                "routings reads a Python loop of MoE layers: use experts > 0 and scan_layers=False"
            )
        return _routings(self, tokens)

    def layer_keys(self, dropout_key: jax.Array) -> jax.Array:
        """One dropout key per layer, from the step's key."""
        return jax.random.split(dropout_key, self.cfg.layers)

    def unembed(self, x: jax.Array) -> jax.Array:
        """Float32 logits from the blocks' output: final norm, then the output head (the
        sequence back in its natural order under context parallelism, and split as the
        residual stream is, so that each device computes the logits of its own tokens)."""
        split = context_split(x.shape[1])
        if split is not None:
            x = constrain(from_layout(x, split), RESIDUAL)
        x = self.final_norm(x)
        if self.cfg.tie_embeddings:
            table = compute_copy(self.embed, x.dtype)
            return placed_einsum("ble,ve->blv", x, table, LOGITS).astype(jnp.float32)
        head = compute_copy(self.head, x.dtype)
        return placed_einsum("ble,ev->blv", x, head, LOGITS).astype(jnp.float32)

    def run_blocks(self, x: jax.Array, keys: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """Every block in turn (a Python loop, or a scan over stacked blocks, held in rounds
        or not: `group_layers`), remat if set; the output and the sum of the layers'
        load-balancing losses."""
        policy = remat_policy(self.cfg.remat)
        apply: Callable[[Block, jax.Array, jax.Array | None], tuple[jax.Array, jax.Array]] = (
            nnx.remat(lambda block, h, key: block.with_aux(h, key), policy=REMAT_POLICIES[policy])
            if policy
            else (lambda block, h, key: block.with_aux(h, key))
        )
        total = jnp.zeros((), jnp.float32)
        if not self.cfg.scan_layers:
            for i, block in enumerate(self.blocks):
                x, aux = apply(block, x, None if keys is None else keys[i])
                total = total + aux
            return x, total

        @nnx.scan(in_axes=(0, nnx.Carry, 0 if keys is not None else None), out_axes=nnx.Carry)
        def run(
            block: Block, carry: tuple[jax.Array, jax.Array], key: jax.Array | None
        ) -> tuple[jax.Array, jax.Array]:
            h, aux = apply(block, carry[0], key)
            return h, carry[1] + aux

        return run(plain_stack(self.blocks), (x, total), keys)


def plain_stack(blocks: nnx.Module) -> nnx.Module:
    """Stacked blocks as one stack of layers, whether or not they are held in rounds."""
    graphdef, state = nnx.split(blocks)
    if layer_rounds(state) == 1:
        return blocks
    return nnx.merge(graphdef, group_layers(state, 1))


def create(cfg: Config, seed: int = 0) -> Transformer:
    """A Transformer with weights drawn from `seed` (unsharded: see nnxscale.init for shards)."""
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def count_params(model: nnx.Module) -> int:
    """Number of parameter elements."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@nnx.jit
def _routings(model: Transformer, tokens: jax.Array) -> list[Routing | Routed]:
    """Each MoE layer's routing of `tokens` through the model's Python loop of blocks."""
    x, found = model.embed_tokens(tokens), []
    for block in model.blocks:
        x, routing = block.with_routing(x, None)
        found.append(routing)
    return found
